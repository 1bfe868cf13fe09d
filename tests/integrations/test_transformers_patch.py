"""patch / unpatch against the peer: transformers' own experts on tiny random models (CPU, float32).

For each supported architecture and both ways in (transformers' experts interface, module
swap): the patched model's logits equal the unpatched model's within float32 rounding
(|diff| <= 1e-5 + 1e-5 * |logit|; the two sum the K expert outputs in different orders),
greedy generate() gives the same 32 tokens, unpatch restores the model bit for bit, the
weights are the model's own storage, and a recorder sees exactly the model's routing.
"""

from __future__ import annotations

import sys

import pytest
import torch

from .tiny_models import ARCHS, build, greedy, prompts, transformers

from moekit.integrations.transformers import (  # noqa: E402
    IMPLEMENTATION, MoekitExperts, moe_blocks, num_routed_experts, patch, patched_blocks, routing_taps, unpatch,
)
from moekit.routing import RoutingRecorder  # noqa: E402

RTOL = ATOL = 1e-5  # float32; measured max |diff| <= 1e-6 on logits of magnitude ~4


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("method", ["interface", "swap"])
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(arch, method):
    model = build(arch)
    ids = prompts()
    want = logits(model, ids)
    patch(model, method=method)
    got = logits(model, ids)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    # The comparison has teeth: the experts move the logits by far more than the tolerance.
    for _, block in moe_blocks(model):
        block.experts.down_proj.data.mul_(0.5)
    assert (logits(model, ids) - want).abs().max() > 0.05


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generate_same_tokens(arch):
    model = build(arch, seed=2)
    ids = prompts(batch=2, length=8, seed=3)
    want = greedy(model, ids)
    patch(model)
    got = greedy(model, ids)
    assert got.shape == (2, 32)
    assert torch.equal(got, want)


@pytest.mark.parametrize("method", ["interface", "swap"])
def test_unpatch_restores(method):
    model = build("qwen2_moe")
    config = model.config
    before_impl = config._experts_implementation
    ids = prompts()
    want = logits(model, ids)
    keys = list(model.state_dict())
    originals = [block.experts for _, block in moe_blocks(model)]
    blocks = patch(model, method=method)
    assert [p.method for p in blocks] == [method] * len(originals)
    assert list(model.state_dict()) == keys  # same parameter names while patched
    if method == "interface":
        assert config._experts_implementation == IMPLEMENTATION
    else:
        assert all(isinstance(block.experts, MoekitExperts) for _, block in moe_blocks(model))
    unpatch(model)
    assert config._experts_implementation == before_impl
    assert [block.experts for _, block in moe_blocks(model)] == originals
    assert not any("_moekit_backend" in e.__dict__ for e in originals)
    assert torch.equal(logits(model, ids), want)
    patch(model, method=method)  # and it can be patched again
    torch.testing.assert_close(logits(model, ids), want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("method", ["interface", "swap"])
def test_weights_are_shared(method):
    model = build("olmoe")
    blocks = patch(model, method=method)
    for p in blocks:
        compute = p.backend.compute
        assert compute.w13.data_ptr() == p.original_experts.gate_up_proj.data_ptr()
        assert compute.w2.data_ptr() == p.original_experts.down_proj.data_ptr()
    # An update to the model's weights is what moekit runs next (no stale copy).
    ids = prompts()
    with torch.no_grad():
        for p in blocks:
            p.original_experts.gate_up_proj.mul_(1.5)
    got = logits(model, ids)
    unpatch(model)
    torch.testing.assert_close(got, logits(model, ids), rtol=RTOL, atol=ATOL)


def test_compute_follows_a_dtype_change():
    """model.double() after patch: the compute is rebuilt on the new storage (float64 now; the
    dispatcher's combine still sums in float32, by its contract, hence float32's tolerance)."""
    model = build("mixtral")
    model.set_experts_implementation("eager")  # the reference in float64: grouped_mm has no float64 kernel
    ids = prompts()
    blocks = patch(model)
    model.double()
    got = logits(model, ids)
    assert got.dtype == torch.float64
    for p in blocks:
        assert p.backend.compute.w13.dtype == torch.float64
        assert p.backend.compute.w13.data_ptr() == p.original_experts.gate_up_proj.data_ptr()
    unpatch(model)
    torch.testing.assert_close(got, logits(model, ids), rtol=RTOL, atol=ATOL)


def _capture_experts_inputs(model) -> tuple[list, list]:
    """Hooks on every experts module that keep the (topk_ids, topk_weights) transformers passes it."""
    seen = []
    hooks = [block.experts.register_forward_pre_hook(lambda m, args: seen.append((args[1], args[2])))
             for _, block in moe_blocks(model)]
    return seen, hooks


@pytest.mark.parametrize("arch", ["olmoe", "deepseek_v3"])
def test_recorder_sees_the_models_routing(arch):
    """The trace recorded through the integration holds exactly the routing the patched model's
    experts receive, and the same expert picks as the unpatched model (its weights within float32
    rounding: the hidden states differ in the last bits after the first MoE layer)."""
    model = build(arch)
    ids = prompts(batch=2, length=6)
    unpatched, hooks = _capture_experts_inputs(model)
    greedy(model, ids, new_tokens=4)
    for h in hooks:
        h.remove()
    patch(model)
    patched, hooks = _capture_experts_inputs(model)
    with RoutingRecorder(routing_taps(model)) as rec:
        greedy(model, ids, new_tokens=4)
    for h in hooks:
        h.remove()
    trace = rec.to_trace(num_routed_experts(model))
    L = len(moe_blocks(model))
    assert (trace.num_steps, trace.num_layers, trace.top_k) == (4, L, 2)  # prefill + 3 decode steps
    assert trace.num_tokens == 2 * 6
    assert len(patched) == len(unpatched) == 4 * L
    for step in range(4):
        for layer in range(L):
            got_ids = torch.from_numpy(trace.topk_ids[step, layer])
            got_w = torch.from_numpy(trace.topk_weights[step, layer])
            want_ids, want_w = patched[step * L + layer]
            n = want_ids.shape[0]
            assert n == (12 if step == 0 else 2)
            assert torch.equal(got_ids[:n], want_ids) and torch.equal(got_w[:n], want_w.float())
            assert (got_ids[n:] == -1).all()
            peer_ids, peer_w = unpatched[step * L + layer]
            assert torch.equal(got_ids[:n], peer_ids)
            torch.testing.assert_close(got_w[:n], peer_w.float(), rtol=RTOL, atol=ATOL)


def test_unpatched_model_sharing_the_config_keeps_its_experts():
    """Two models built from one config object: patching one leaves the other on transformers' experts."""
    a = build("qwen3_moe", seed=0)
    b = type(a)(a.config).eval()
    with torch.no_grad():
        for pa, pb in zip(a.parameters(), b.parameters()):
            pb.copy_(pa * 0.9)
    ids = prompts()
    want_b = logits(b, ids)
    patch(a)
    assert torch.equal(logits(b, ids), want_b)
    unpatch(a)


def test_unsupported_moe_block_is_named():
    config = transformers.GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                       num_experts_per_tok=2, layer_types=["full_attention"])
    model = transformers.GptOssForCausalLM(config)
    with pytest.raises(ValueError, match=r"unsupported MoE block type .*GptOssMLP .*model\.layers\.0\.mlp"):
        patch(model)
    assert "_moekit_patch" not in model.__dict__


def test_dense_model_has_no_moe_block():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match="LlamaForCausalLM has no MoE block"):
        patch(transformers.LlamaForCausalLM(config))


def test_bad_arguments():
    model = build("olmoe")
    with pytest.raises(ValueError, match="experts must be one of"):
        patch(model, experts="cuda")
    with pytest.raises(ValueError, match="method must be one of"):
        patch(model, method="monkey")
    with pytest.raises(ValueError, match="kernel_config is for the fused experts"):
        patch(model, kernel_config=object())
    with pytest.raises(ValueError, match="is not patched"):
        unpatch(model)
    from moekit.ep import AllToAllDispatcher

    with pytest.raises(ValueError, match="dispatcher routes 4 experts; .* num_experts=8"):
        patch(model, dispatcher=AllToAllDispatcher(4))
    with pytest.raises(ValueError, match="must be a moekit Dispatcher"):
        patch(model, dispatcher=object())
    patch(model)
    with pytest.raises(ValueError, match="already patched"):
        patch(model)
    assert len(patched_blocks(model)) == 2


def test_old_transformers_is_refused(monkeypatch):
    model = build("olmoe")
    # sys.modules' entry, not this module's name: transformers can swap its lazy module object.
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.57.1")
    with pytest.raises(ValueError, match=r"needs transformers >= 5\.0, found 4\.57\.1"):
        patch(model)


def _expert_parallel_rank(rank: int, world_size: int, arch: str):
    from moekit.ep import AllToAllDispatcher

    model = build(arch, seed=4)
    ids = prompts(batch=1, length=5 + 3 * rank, seed=10 + rank)  # each rank its own batch and length
    want = logits(model, ids)
    blocks = patch(model, dispatcher=AllToAllDispatcher(num_routed_experts(model)))
    local = blocks[0].backend.compute.w13.shape[0]
    got = logits(model, ids)
    return (got - want).abs().max().item(), want.abs().max().item(), local


# One launch, shared with the other 2-rank tests (tests/rank_pool.py).
@pytest.mark.ranks(lambda: (_expert_parallel_rank, "qwen2_moe"), world_size=2)
def test_expert_parallel_two_ranks(pooled_launch):
    """Each of 2 gloo ranks holds half the experts and runs its own batch; logits match one process."""
    for diff, scale, local in pooled_launch():
        assert local == 4
        assert diff <= ATOL + RTOL * scale
