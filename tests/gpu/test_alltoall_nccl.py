"""AllToAllDispatcher over NCCL on 2 GPUs: the same bitwise checks as the gloo tests."""

from __future__ import annotations

import pytest
import torch

from moekit.ep import AllToAllDispatcher, current_device, launch
from moekit.ep.reference import expected_dispatch
from moekit.moe.reference import reference_slot_sum
from tests.ep.cases import CASES, build_case, expected_combine, fake_experts

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)


def _worker(rank, world_size, cases):
    device = current_device()
    out = {}
    for name, seed, dtype in cases:
        xs, ids, ws, E = build_case(name, world_size, seed, dtype=dtype)
        d = AllToAllDispatcher(E)
        dispatched = d.dispatch(xs[rank].to(device), ids[rank].to(device), ws[rank].to(device))
        y = d.combine(dispatched.tokens.clone(), dispatched)
        y_fake = d.combine(fake_experts(dispatched.tokens, rank), dispatched)
        out[(name, seed, str(dtype))] = dict(tokens=dispatched.tokens.cpu(), counts=dispatched.counts.cpu(),
                                             src_token=dispatched.handle.src_token.cpu(), y=y.cpu(),
                                             y_fake=y_fake.cpu())
    return out


def test_nccl_dispatch_combine_bitwise():
    cases = [(name, seed, dtype) for name in CASES for seed in (0, 1) for dtype in (torch.float32, torch.bfloat16)]
    results = launch(_worker, 2, cases, backend="nccl")
    for name, seed, dtype in cases:
        xs, ids, ws, E = build_case(name, 2, seed, dtype=dtype)
        want_fake = expected_combine(xs, ids, ws, E, dtype)
        for rank in range(2):
            got = results[rank][(name, seed, str(dtype))]
            for e, exp in enumerate(expected_dispatch(xs, ids, E, rank)):
                n = int(got["counts"][e])
                assert torch.equal(got["tokens"][e, :n], exp["tokens"]), (name, rank, e)
                assert torch.equal(got["src_token"][e, :n], exp["src_token"]), (name, rank, e)
            T, K = ids[rank].shape
            want = reference_slot_sum(xs[rank].unsqueeze(1).expand(T, K, xs[rank].shape[1]), ids[rank], ws[rank], dtype)
            assert torch.equal(got["y"], want), (name, seed, rank)
            assert torch.equal(got["y_fake"], want_fake[rank]), (name, seed, rank)
