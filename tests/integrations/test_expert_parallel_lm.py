"""A transformers MoE model served with expert parallelism on gloo ranks, against one process.

Each rank builds its share with :func:`moekit.integrations.lm.build_expert_parallel` (the attention
and shared weights, and only its own experts, drawn per tensor and per expert) and generates
greedily from its own prompts; the reference is the single-process model built with the same
recipe, running transformers' own experts (an independent implementation of the MoE block).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")

from moekit.integrations.lm import build_expert_parallel, generate_tokens, local_expert_count, seeded_model  # noqa: E402
from moekit.integrations.lm.seeded import stream_seed  # noqa: E402
from moekit.integrations.transformers import patch  # noqa: E402
from tests.ep.deadline import run_ranks  # noqa: E402

E, VOCAB, PROMPT, NEW, BATCH = 8, 96, 6, 5, 2
ARCHS = ("olmoe", "qwen3_moe")


def tiny_config(arch: str):
    """E experts, top-2. The weights are drawn with std 0.2 (about 1/sqrt(hidden)), so the experts
    move the logits by O(1) (at transformers' 0.02 a wrong expert path would hide in rounding)."""
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, pad_token_id=0, bos_token_id=None, eos_token_id=None,
                  num_experts_per_tok=2, initializer_range=0.2, tie_word_embeddings=False)
    if arch == "olmoe":
        return transformers.OlmoeConfig(**common, intermediate_size=24, num_experts=E)
    return transformers.Qwen3MoeConfig(**common, moe_intermediate_size=24, intermediate_size=64, num_experts=E,
                                       norm_topk_prob=True, head_dim=8, decoder_sparse_step=1, mlp_only_layers=[])


def prompts(rank: int) -> torch.Tensor:
    """Rank ``rank``'s own prompts (every rank serves a different batch)."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(3, VOCAB, (BATCH, PROMPT), generator=g)


class ShapeLog(TorchDispatchMode):
    """Every tensor shape an operator produces while active (allocations included)."""

    def __init__(self):
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.shapes.add(tuple(t.shape))
        return out


def full_expert_shapes(config) -> set[tuple[int, ...]]:
    H = config.hidden_size
    N = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return {(E, 2 * N, H), (E, H, N)}


def serve_rank(rank: int, world_size: int, combine_orders: tuple[str, ...]) -> dict:
    """On each rank: build each architecture's share per combine order, check what it allocated, generate."""
    torch.set_num_threads(1)
    out = {}
    for arch in ARCHS:
        config = tiny_config(arch)
        for order in combine_orders:
            log = ShapeLog()
            with log:
                model = build_expert_parallel(config, experts="torch", dtype=torch.float32, device="cpu",
                                              combine_order=order)
            ids = prompts(rank)
            with torch.no_grad():
                logits = model(ids).logits
            out[arch, order] = dict(local_experts=local_expert_count(model), tokens=generate_tokens(model, ids, NEW),
                                    full_allocated=bool(log.shapes & full_expert_shapes(config)), logits=logits)
            if arch == "olmoe" and order == "slot" and world_size == 2:
                # torch.compile of the rank's share: the graph breaks around the exchange, which runs as it is.
                compiled = torch.compile(model, fullgraph=False, backend="eager")
                with torch.no_grad():
                    out["compiled"] = (compiled(ids).logits, logits)
                torch._dynamo.reset()
    return out


ORDERS = {2: ("slot", "rank"), 4: ("slot",)}  # one launch per world size serves every test of it


@pytest.fixture(scope="module")
def served():
    cache = {}

    def get(world_size: int) -> list[dict]:
        if world_size not in cache:
            cache[world_size] = run_ranks(serve_rank, world_size, ORDERS[world_size], deadline=300.0,
                                          timeout=120.0)[0]
        return cache[world_size]

    return get


def reference(arch: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, prompt logits) of the single-process model on ``rank``'s prompts, transformers' own experts."""
    model = seeded_model(tiny_config(arch), dtype=torch.float32)
    ids = prompts(rank)
    with torch.no_grad():
        logits = model(ids).logits
    return generate_tokens(model, ids, NEW), logits


@pytest.mark.parametrize("world_size,combine_order", [(2, "slot"), (2, "rank"), (4, "slot")])
def test_ranks_generate_the_single_process_tokens(world_size, combine_order, served):
    torch.set_num_threads(1)
    for rank, per_arch in enumerate(served(world_size)):
        for arch in ARCHS:
            got = per_arch[arch, combine_order]
            assert got["local_experts"] == E // world_size, (arch, rank)
            assert not got["full_allocated"], f"{arch} rank {rank} allocated a full expert tensor"
            want_tokens, want_logits = reference(arch, rank)
            assert torch.equal(got["tokens"], want_tokens), (arch, rank, got["tokens"], want_tokens)
            # fp32: the ranks' experts and transformers' loop differ only in the order of float sums.
            torch.testing.assert_close(got["logits"], want_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world_size", [2, 4])
def test_combine_order_slot_is_bitwise_across_world_sizes(world_size, served):
    """With combine_order="slot" the K slot outputs of a token are summed by one function in slot
    order whatever the rank count, and each expert's rows are computed row by row alike: the
    model's logits on one process (the all-to-all dispatcher with no process group) and on P
    ranks are bitwise equal."""
    from moekit.ep import AllToAllDispatcher

    torch.set_num_threads(1)
    results = served(world_size)
    for arch in ARCHS:
        model = seeded_model(tiny_config(arch), dtype=torch.float32)
        patch(model, experts="torch", dispatcher=AllToAllDispatcher(E, hidden=32, top_k=2, combine_order="slot"))
        for rank in range(world_size):
            with torch.no_grad():
                want = model(prompts(rank)).logits
            assert torch.equal(results[rank][arch, "slot"]["logits"], want), (arch, rank)


def test_rank_slice_is_the_single_process_models_experts():
    """A rank's model, built without a process group, holds exactly rows rank*E/P.. of the full
    model's experts, and every other weight of the full model."""
    config = tiny_config("qwen3_moe")
    full = seeded_model(config).state_dict()
    for world_size in (2, 4):
        for rank in range(world_size):
            part = seeded_model(config, rank=rank, world_size=world_size).state_dict()
            assert part.keys() == full.keys()
            lo, hi = rank * E // world_size, (rank + 1) * E // world_size
            for name, value in part.items():
                want = full[name][lo:hi] if name.endswith(("experts.gate_up_proj", "experts.down_proj")) else full[name]
                assert torch.equal(value, want), (world_size, rank, name)


def test_experts_matter_and_seeds_differ():
    """The check above could not fail if the experts did nothing or every expert were equal."""
    config = tiny_config("olmoe")
    model = seeded_model(config)
    w = model.model.layers[0].mlp.experts.gate_up_proj
    assert not torch.equal(w[0], w[1])
    assert stream_seed(0, "a", 0) != stream_seed(0, "a", 1) != stream_seed(0, "a")
    ids = prompts(0)
    with torch.no_grad():
        before = model(ids).logits
        for layer in model.model.layers:
            layer.mlp.experts.down_proj.mul_(0.5)
        after = model(ids).logits
    assert (before - after).abs().max() > 1e-2


def test_a_rank_share_needs_its_own_dispatcher():
    model = seeded_model(tiny_config("olmoe"), rank=1, world_size=2)
    with pytest.raises(ValueError, match="rank 1's of 2"):
        patch(model, experts="torch")  # no process group: a one-process dispatcher


def test_a_compiled_rank_share_equals_the_eager_one(served):
    """torch.compile (no full graph) of an expert-parallel model: the exchange runs outside the
    graphs dynamo traces around it (the eager backend: where the graph breaks is what is
    checked here; the compiled local path is tests/integrations/test_transformers_local.py's);
    the prompt logits are the eager ones."""
    for rank, result in enumerate(served(2)):
        compiled, eager = result["compiled"]
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5, msg=lambda m: f"rank {rank}: {m}")
