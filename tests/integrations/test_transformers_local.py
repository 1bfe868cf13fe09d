"""A patched transformers model on one process: the local (token-major) path, no host reads in a
patched block, torch.compile with no graph break, gradients, and patch / unpatch edge cases."""

from __future__ import annotations

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():  # the fused experts run in Triton's interpreter here
    os.environ.setdefault("TRITON_INTERPRET", "1")

from .tiny_models import ARCHS, build, prompts  # noqa: E402

from moekit.ep.local import LocalDispatcher  # noqa: E402
from moekit.integrations.transformers import moe_blocks, patch, unpatch  # noqa: E402
from tests.moe.test_local_path import no_host_reads  # noqa: E402

RTOL = ATOL = 1e-5


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_one_process_uses_the_local_dispatcher():
    model = build("olmoe")
    blocks = patch(model)
    assert all(isinstance(b.backend.dispatcher, LocalDispatcher) for b in blocks)


@pytest.mark.parametrize("arch", ["olmoe", "qwen3_moe", "mixtral"])
@pytest.mark.parametrize("experts", ["torch", "fused"])
def test_patched_blocks_match_and_read_nothing_back(arch, experts):
    """Logits against the unpatched model (transformers' experts), and inside every patched
    experts call no Tensor.item / tolist / cpu / numpy (hooks arm the check around the call)."""
    model = build(arch)
    ids = prompts()
    want = logits(model, ids)
    patch(model, experts=experts)
    armed = []

    def arm(module, args):
        ctx = no_host_reads()
        ctx.__enter__()
        armed.append(ctx)

    calls = []

    def disarm(module, args, output):
        armed.pop().__exit__(None, None, None)
        calls.append(1)

    for _, block in moe_blocks(model):
        block.experts.register_forward_pre_hook(arm)
        block.experts.register_forward_hook(disarm)
    if experts == "torch":
        got = logits(model, ids)
    else:  # the interpreter itself reads tensors on the host: check the torch path's code, run this one plainly
        for _, block in moe_blocks(model):
            block.experts._forward_pre_hooks.clear()
            block.experts._forward_hooks.clear()
        got = logits(model, ids)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    assert experts != "torch" or len(calls) == len(moe_blocks(model))


# "fused" with RaMP's "auto" policy: the step scope the patched model opens around its
# forward stays out of a compiled graph.
@pytest.mark.parametrize("experts", ["torch", "fused"])
def test_compiles_with_no_graph_break(experts):
    model = build("olmoe")
    ids = prompts()
    want = logits(model, ids)
    patch(model, experts=experts, **(dict(kernel_config="auto") if experts == "fused" else {}))
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(ids)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(logits(compiled, ids), want, rtol=RTOL, atol=ATOL)
    torch._dynamo.reset()


def test_torch_experts_train_the_models_weights():
    """Gradients reach the model's own expert parameters through the torch experts, equal to
    transformers' own backward."""
    ids = prompts(batch=2, length=6)
    grads = []
    for patched in (False, True):
        model = build("mixtral", seed=1)
        model.set_experts_implementation("eager")
        if patched:
            patch(model, experts="torch")
        model(ids).logits.square().mean().backward()
        grads.append([b.experts.gate_up_proj.grad for _, b in moe_blocks(model)])
    for want, got in zip(*grads):
        assert got is not None and want.abs().max() > 0
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_fused_experts_refuse_a_backward():
    model = build("olmoe")
    patch(model, experts="fused")
    out = model(prompts(batch=1, length=4)).logits  # a forward with gradients enabled still runs
    with pytest.raises(RuntimeError, match="no backward"):
        out.sum().backward()


def test_swap_then_assign_then_unpatch_keeps_the_new_weights():
    model = build("olmoe", seed=2)
    ids = prompts()
    patch(model, method="swap")
    other = build("olmoe", seed=3)
    model.load_state_dict(other.state_dict(), assign=True)
    unpatch(model)
    torch.testing.assert_close(logits(model, ids), logits(other, ids), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("method", ["interface", "swap"])
def test_a_deep_copy_unpatches_on_its_own(method):
    model = build("qwen3_moe")
    ids = prompts()
    want = logits(model, ids)
    patch(model, method=method)
    twin = copy.deepcopy(model)
    torch.testing.assert_close(logits(twin, ids), want, rtol=RTOL, atol=ATOL)
    unpatch(twin)
    assert twin.config._experts_implementation != "moekit"
    torch.testing.assert_close(logits(twin, ids), want, rtol=RTOL, atol=ATOL)
    unpatch(model)
    torch.testing.assert_close(logits(model, ids), want, rtol=RTOL, atol=ATOL)


def test_a_dispatcher_for_another_shape_is_refused_at_patch():
    model = build("olmoe")  # hidden 32, top-2, 8 experts
    with pytest.raises(ValueError, match="hidden=64"):
        patch(model, dispatcher=LocalDispatcher(8, hidden=64))
    with pytest.raises(ValueError, match="top_k=3"):
        patch(model, dispatcher=LocalDispatcher(8, top_k=3))


def test_ramp_policies_open_a_step_per_forward():
    from moekit.ramp import select

    model = build("olmoe")
    seen = []
    model.model.layers[0].register_forward_pre_hook(lambda m, a: seen.append(select._GLOBAL_STEP.depth))
    patch(model, experts="fused", kernel_config="auto")
    logits(model, prompts())
    assert seen == [1] and select._GLOBAL_STEP.depth == 0
    unpatch(model)
    logits(model, prompts())
    assert seen == [1, 0]
