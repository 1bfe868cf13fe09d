"""The fused-MoE calls as users and modules make them: a policy name or a config in, the kernel out.

:func:`fused_moe` and :func:`fused_moe_expert_major` take what :mod:`moekit.ops.policy` takes
(``None`` / ``"static"``, ``"default"``, ``"ramp"``, ``"auto"`` or a
:class:`~moekit.kernels.KernelConfig`). Called eagerly they resolve the config and launch the
kernels directly; traced by ``torch.compile`` they become the custom operators of
:mod:`moekit.ops.library` (opaque nodes, captured by CUDA graphs).

The host path of an eager call is kept short: the argument checks run once per signature (the
shapes, strides, dtypes and devices of every tensor; a new token count is a new signature), the
config comes from the policy's dict, the kernels launch straight from their binaries after the
first call of a signature (:mod:`moekit.kernels.bound`), from the third on the call is replayed
from its recorded launches (:mod:`moekit.kernels.recipe`), and nothing is read back from the
device (except by the ``"auto"`` / ``"ramp"`` policies, whose reads are RaMP's, once per step).
"""

from __future__ import annotations

import torch

from moekit.kernels import recipe
from moekit.kernels.configs import KernelConfig
from moekit.ops.policy import check_policy, expert_major_config, token_config

_CHECKED: set = set()  # signatures whose arguments passed the kernels' checks
_CONFIGS_CHECKED: set = set()  # (config, fp8) pairs checked against the precision's rules
_MAX_REMEMBERED = 4096


def signature(*tensors) -> tuple:
    """What the kernels' checks depend on, for every argument (None stays None)."""
    return tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.device) if isinstance(t, torch.Tensor)
                 else type(t) for t in tensors)


def alignments(tensors) -> tuple:
    """Whether each tensor's address is 16-byte aligned (Triton specializes pointers on it)."""
    return tuple(t is not None and t.data_ptr() % 16 == 0 for t in tensors)


def _remember(done: set, key) -> None:
    if len(done) >= _MAX_REMEMBERED:  # many distinct token counts: forget, check again as they come
        done.clear()
    done.add(key)


def _checked_config(config: KernelConfig, fp8: bool) -> KernelConfig:
    key = (config, fp8)
    if key not in _CONFIGS_CHECKED:
        from moekit.kernels.inputs import check_config

        check_config(config, fp8)
        _remember(_CONFIGS_CHECKED, key)
    return config


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, config: KernelConfig | str | None = None, *,
              w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              x_scale: torch.Tensor | None = None, layer=None) -> torch.Tensor:
    """y[M, H] = sum_k topk_weights[:, k] * SwiGLU-expert_{topk_ids[:, k]}(x): the token-major
    fused kernel (:func:`moekit.kernels.fused_moe`: dtypes, FP8 W8A8, masking) with its config
    chosen by ``config`` (a policy of :mod:`moekit.ops.policy` or a KernelConfig; None is
    ``"static"``). ``layer``: a key per MoE layer for RaMP's per-step cache (``"auto"`` /
    ``"ramp"``). Under ``torch.compile`` this is ``torch.ops.moekit.fused_moe``."""
    policy = check_policy(config)
    if torch.compiler.is_compiling():
        from moekit.ops.library import policy_to_str

        return torch.ops.moekit.fused_moe(x, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale, x_scale,
                                          policy_to_str(policy))
    return eager_fused_moe(x, w13, w2, topk_ids, topk_weights, policy, w13_scale=w13_scale, w2_scale=w2_scale,
                           x_scale=x_scale, layer=layer)


def eager_fused_moe(x, w13, w2, topk_ids, topk_weights, policy: KernelConfig | str, *, w13_scale=None,
                    w2_scale=None, x_scale=None, layer=None, replay: bool = True) -> torch.Tensor:
    """:func:`fused_moe` run now: checks once per signature, the policy's config, the launch
    (``replay``: from the call's recorded launches where it can, :mod:`moekit.kernels.recipe`)."""
    from moekit.kernels.fused_moe import check_fused_moe, run_fused_moe

    key = signature(x, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale, x_scale)
    if key not in _CHECKED:
        check_fused_moe(x, w13, w2, topk_ids, topk_weights, None, w13_scale=w13_scale, w2_scale=w2_scale,
                        x_scale=x_scale)
        _remember(_CHECKED, key)
    config = _checked_config(token_config(policy, topk_ids, w13, w2, layer=layer), w13.dtype == torch.float8_e4m3fn)
    tensors = (x, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale, x_scale)
    return recipe.run(("fused_moe", key, config, alignments(tensors)), tensors, lambda: run_fused_moe(
        x, w13, w2, topk_ids, topk_weights, config, w13_scale=w13_scale, w2_scale=w2_scale, x_scale=x_scale),
        replay=replay)


def fused_moe_expert_major(tokens: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                           config: KernelConfig | str | None = None, *, w13_scale: torch.Tensor | None = None,
                           w2_scale: torch.Tensor | None = None, token_scales: torch.Tensor | None = None,
                           top_k: int | None = None, layer=None) -> torch.Tensor:
    """The experts on a dispatcher's expert-major layout (:func:`moekit.kernels.fused_moe_expert_major`)
    with the config chosen by ``config`` as in :func:`fused_moe` (``top_k``: the router's K,
    which names RaMP's model file where known). Under ``torch.compile`` this is
    ``torch.ops.moekit.fused_moe_expert_major``."""
    policy = check_policy(config)
    if torch.compiler.is_compiling():
        from moekit.ops.library import policy_to_str

        return torch.ops.moekit.fused_moe_expert_major(tokens, counts, w13, w2, w13_scale, w2_scale, token_scales,
                                                       policy_to_str(policy))
    return eager_fused_moe_expert_major(tokens, counts, w13, w2, policy, w13_scale=w13_scale, w2_scale=w2_scale,
                                        token_scales=token_scales, top_k=top_k, layer=layer)


def eager_fused_moe_expert_major(tokens, counts, w13, w2, policy: KernelConfig | str, *, w13_scale=None,
                                 w2_scale=None, token_scales=None, top_k=None, layer=None,
                                 replay: bool = True) -> torch.Tensor:
    from moekit.kernels.expert_major import check_fused_moe_expert_major, run_fused_moe_expert_major

    key = ("expert_major",) + signature(tokens, counts, w13, w2, w13_scale, w2_scale, token_scales)
    if key not in _CHECKED:
        check_fused_moe_expert_major(tokens, counts, w13, w2, None, w13_scale=w13_scale, w2_scale=w2_scale,
                                     token_scales=token_scales)
        _remember(_CHECKED, key)
    config = expert_major_config(policy, counts, tokens.shape[1], w13, w2, top_k=top_k, layer=layer)
    config = _checked_config(config, w13.dtype == torch.float8_e4m3fn)
    tensors = (tokens, counts, w13, w2, w13_scale, w2_scale, token_scales)
    return recipe.run((key, config, alignments(tensors)), tensors, lambda: run_fused_moe_expert_major(
        tokens, counts, w13, w2, config, w13_scale=w13_scale, w2_scale=w2_scale, token_scales=token_scales),
        replay=replay)
