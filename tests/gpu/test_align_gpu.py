"""Token alignment's Triton kernels on a GPU: equal to the torch ops at serving sizes, and in a graph.

The CPU tests (tests/kernels/test_kernels_align.py) check both implementations against a
plain Python reference at interpreter sizes; here the compiled kernels meet the sizes the
benchmarks use (up to M = 4096 at top-8 over 256 experts: 32 chunks, 512 histogram bins).
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

pytest.importorskip("triton")

from moekit.kernels.align import align_tokens_torch, align_tokens_triton  # noqa: E402
from moekit.routing.generate import synthetic_routing  # noqa: E402


def _assert_same(a, b):
    assert torch.equal(a.sorted_ids, b.sorted_ids)
    assert torch.equal(a.block_expert, b.block_expert)
    assert torch.equal(a.num_padded, b.num_padded)


@pytest.mark.parametrize("M", [1, 4, 16, 64, 129, 256, 1024, 4096])
@pytest.mark.parametrize("E,K", [(8, 2), (64, 8), (256, 8)])
@pytest.mark.parametrize("bm", [16, 64, 128])
def test_align_triton_equals_torch_at_serving_sizes(M, E, K, bm):
    ids, _ = synthetic_routing(M, E, K, beta=0.4, seed=M + E + bm)
    ids[torch.rand(ids.shape, generator=torch.Generator().manual_seed(M)) < 0.05] = -1
    ids = ids.cuda()
    _assert_same(align_tokens_triton(ids, E, bm), align_tokens_torch(ids, E, bm))


@pytest.mark.parametrize("M", [8, 2048])  # one program, several chunks
def test_align_triton_replays_in_a_graph_with_new_routing(M):
    E, K, bm = 64, 8, 32
    ids = torch.zeros(M, K, dtype=torch.int64, device="cuda")
    align_tokens_triton(ids, E, bm)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        al = align_tokens_triton(ids, E, bm)
    for seed in range(20):
        new, _ = synthetic_routing(M, E, K, beta=0.3 + 0.03 * seed, seed=seed)
        ids.copy_(new)
        graph.replay()
        _assert_same(al, align_tokens_torch(ids, E, bm))
