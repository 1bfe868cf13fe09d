"""The fused-MoE kernels as PyTorch custom operators (``torch.ops.moekit.*``).

``torch.compile`` cannot look inside a Triton launch wrapped in Python (shape logic, dict
lookups, a launch grid computed on the host): registered as custom operators with fake
implementations, the kernels are single opaque nodes of a compiled graph, with their output
shapes known, and CUDA graphs (``mode="reduce-overhead"``) capture their launches.

* ``moekit::fused_moe(x, w13, w2, topk_ids, topk_weights, w13_scale?, w2_scale?, x_scale?, config)``
  -> ``[M, H]``: :func:`moekit.kernels.fused_moe`, bf16/fp16/fp32 or FP8 W8A8 by the weights'
  dtype.
* ``moekit::fused_moe_expert_major(tokens, counts, w13, w2, w13_scale?, w2_scale?, token_scales?,
  config)`` -> ``[E_local, capacity, H]``: :func:`moekit.kernels.fused_moe_expert_major`.

``config`` is a policy name of :mod:`moekit.ops.policy` or a :attr:`KernelConfig.id`. The
operators launch the kernels without replay (:mod:`moekit.kernels.recipe` says why). The
operators have no backward: their autograd formula raises (the fused kernels are for
inference), so a graph that needs a gradient through them fails loudly instead of returning
none.
"""

from __future__ import annotations

import torch

from moekit.kernels.configs import KernelConfig

_FP8 = torch.float8_e4m3fn
NO_BACKWARD = ("moekit's fused MoE kernels are inference kernels and have no backward; run the experts "
               "with experts='torch' to train, or call them under torch.no_grad() / torch.inference_mode()")


def policy_from_str(config: str) -> KernelConfig | str:
    """A policy name as it is, a KernelConfig id as its config."""
    from moekit.ops.policy import POLICIES

    return config if config in POLICIES else KernelConfig.from_id(config)


def policy_to_str(policy: KernelConfig | str) -> str:
    return policy.id if isinstance(policy, KernelConfig) else policy


@torch.library.custom_op("moekit::fused_moe", mutates_args=())
def fused_moe_op(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor, w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,
                 x_scale: torch.Tensor | None, config: str) -> torch.Tensor:
    from moekit.ops.calls import eager_fused_moe

    return eager_fused_moe(x, w13, w2, topk_ids, topk_weights, policy_from_str(config), w13_scale=w13_scale,
                           w2_scale=w2_scale, x_scale=x_scale, replay=False)


@fused_moe_op.register_fake
def _fused_moe_fake(x, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale, x_scale, config):
    return x.new_empty(x.shape[0], x.shape[1], dtype=torch.bfloat16 if x.dtype == _FP8 else x.dtype)


@torch.library.custom_op("moekit::fused_moe_expert_major", mutates_args=())
def fused_moe_expert_major_op(tokens: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                              w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,
                              token_scales: torch.Tensor | None, config: str) -> torch.Tensor:
    from moekit.ops.calls import eager_fused_moe_expert_major

    return eager_fused_moe_expert_major(tokens, counts, w13, w2, policy_from_str(config), w13_scale=w13_scale,
                                        w2_scale=w2_scale, token_scales=token_scales, replay=False)


@fused_moe_expert_major_op.register_fake
def _fused_moe_expert_major_fake(tokens, counts, w13, w2, w13_scale, w2_scale, token_scales, config):
    return tokens.new_empty(tokens.shape, dtype=torch.bfloat16 if tokens.dtype == _FP8 else tokens.dtype)


def _no_backward(ctx, grad):
    raise RuntimeError(NO_BACKWARD)


def _no_context(ctx, inputs, output):
    return None


fused_moe_op.register_autograd(_no_backward, setup_context=_no_context)
fused_moe_expert_major_op.register_autograd(_no_backward, setup_context=_no_context)
