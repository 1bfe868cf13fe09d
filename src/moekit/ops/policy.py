"""Which kernel configuration a fused-MoE call runs: the one policy above the kernels.

The kernels (:mod:`moekit.kernels`) take a :class:`~moekit.kernels.KernelConfig` and nothing
else. Every caller that does not name a config itself (``moekit.ops.fused_moe``,
:class:`~moekit.moe.FusedExperts`, :class:`~moekit.moe.MoELayer`, the transformers patch) asks
this module, by one of the policy names:

* ``"static"`` (the default): one configuration per (shape, precision, GPU, token-count
  bucket), looked up in a dict, computed the first time the bucket is seen, never reading the
  routing. Where a RaMP model file of the shape ships for the GPU (:mod:`moekit.ramp`), its
  static choice for the bucket (the least mean predicted time over a sweep of routings);
  elsewhere the kernels' own default (``default_config`` / ``expert_major_default``).
* ``"default"``: the kernels' own default for the bucket (no model consulted).
* ``"ramp"``: RaMP where a model ships, reading the routing (one host read, shared by every
  layer of a step) only at token counts where the model predicts the read pays; the static
  choice elsewhere.
* ``"auto"``: RaMP reads the routing once per step (:func:`moekit.ramp.select.step`; a
  patched transformers model opens that step scope itself), whatever the prediction; without a
  model, the region-analysis fallback.

Inside a CUDA graph being captured (a model compiled with ``mode="reduce-overhead"``) nothing
can be read on the host, so ``"ramp"`` and ``"auto"`` take the static choice there.

Token-count buckets: the count itself up to :data:`EXACT_BUCKETS` (decode batch sizes, where
the choice matters most and there are few distinct counts), then powers of two; a bucket's
configuration is the one chosen for its largest count, so every count in it runs a config
sized for it.
"""

from __future__ import annotations

import threading

import torch

from moekit.kernels.configs import KernelConfig

POLICIES = ("static", "default", "ramp", "auto")
EXACT_BUCKETS = 64
_FP8 = torch.float8_e4m3fn

_STATIC: dict[tuple, KernelConfig] = {}
_LOCK = threading.Lock()


def token_bucket(m: int) -> int:
    """The bucket of a token count (or capacity): itself up to :data:`EXACT_BUCKETS`, else the
    next power of two."""
    if m <= EXACT_BUCKETS:
        return max(1, m)
    return 1 << (m - 1).bit_length()


def check_policy(config) -> KernelConfig | str:
    """``config`` as a policy: a KernelConfig, one of :data:`POLICIES`, or None (``"static"``)."""
    if config is None:
        return "static"
    if isinstance(config, KernelConfig) or (isinstance(config, str) and config in POLICIES):
        return config
    raise ValueError(f"config must be a moekit.kernels.KernelConfig, one of {POLICIES} or None, got {config!r}")


def _device_key(device: torch.device) -> str:
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def static_config(m: int, *, num_experts: int, top_k: int | None, hidden: int, intermediate: int, fp8: bool,
                  device: torch.device, family: str = "token", use_model: bool = True) -> KernelConfig:
    """The static choice for token count (``family="token"``) or capacity (``"expert_major"``)
    ``m``: a dict lookup after the bucket's first call (see the module docstring)."""
    bucket = token_bucket(m)
    key = (num_experts, top_k, hidden, intermediate, fp8, _device_key(device), family, use_model, bucket)
    hit = _STATIC.get(key)
    if hit is not None:
        return hit
    config = None
    if use_model and device.type == "cuda":
        from moekit.ramp.select import model_selector_for

        sel = model_selector_for(num_experts, top_k, hidden, intermediate, dtype=_FP8 if fp8 else torch.bfloat16,
                                 device=device, family=family, capacity=bucket if family == "expert_major" else None)
        if sel is not None:
            config = sel.static_choice(bucket)
    if config is None:
        config = _kernel_default(bucket, num_experts, top_k, hidden, intermediate, fp8, family)
    with _LOCK:
        _STATIC[key] = config
    return config


def _kernel_default(m: int, E: int, K: int | None, H: int, N: int, fp8: bool, family: str) -> KernelConfig:
    if family == "expert_major":
        from moekit.kernels.expert_major import expert_major_default

        return expert_major_default(m, fp8)
    from moekit.kernels.configs import default_config
    from moekit.shapes import MoEShape

    return default_config(m, MoEShape("adhoc", E, K, H, N), dtype=_FP8 if fp8 else torch.bfloat16)


def forget_static() -> None:
    """Drop the static table (after model files were added or ``MOEKIT_RAMP_MODELS`` changed)."""
    with _LOCK:
        _STATIC.clear()


def _without_reads(policy: str, routing: torch.Tensor) -> str:
    """RaMP's policies read the routing on the host, which a CUDA graph being captured cannot
    (a compiled model under ``mode="reduce-overhead"``): there they take the static choice."""
    if policy in ("auto", "ramp") and routing.is_cuda and torch.cuda.is_current_stream_capturing():
        return "static"
    return policy


def token_config(policy: KernelConfig | str, topk_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
                 layer=None) -> KernelConfig:
    """The config of a token-major call (``fused_moe``) under ``policy``."""
    if isinstance(policy, KernelConfig):
        return policy
    M, K = topk_ids.shape
    fp8 = w13.dtype == _FP8
    policy = _without_reads(policy, topk_ids)
    if policy == "auto":
        from moekit.ramp.select import auto_config

        return auto_config(topk_ids, w13, w2, layer=layer)
    if policy == "ramp" and topk_ids.is_cuda:
        from moekit.ramp.select import ramp_config

        config = ramp_config(topk_ids, w13, w2, layer=layer)
        if config is not None:
            return config
    return static_config(M, num_experts=w13.shape[0], top_k=K, hidden=w13.shape[2], intermediate=w2.shape[2],
                         fp8=fp8, device=topk_ids.device, use_model=policy != "default")


def expert_major_config(policy: KernelConfig | str, counts: torch.Tensor, capacity: int, w13: torch.Tensor,
                        w2: torch.Tensor, *, top_k: int | None = None, layer=None) -> KernelConfig:
    """The config of an expert-major call (``fused_moe_expert_major``) under ``policy``."""
    if isinstance(policy, KernelConfig):
        return policy
    policy = _without_reads(policy, counts)
    usable = capacity > 0 and counts.dim() == 1 and counts.shape[0] == w13.shape[0]
    if policy == "auto" and usable:
        from moekit.ramp.select import auto_config_expert_major

        return auto_config_expert_major(counts, capacity, w13, w2, top_k=top_k, layer=layer)
    if policy == "ramp" and usable and counts.is_cuda:
        from moekit.ramp.select import ramp_config_expert_major

        config = ramp_config_expert_major(counts, capacity, w13, w2, top_k=top_k, layer=layer)
        if config is not None:
            return config
    return static_config(max(1, capacity), num_experts=w13.shape[0], top_k=top_k, hidden=w13.shape[2],
                         intermediate=w2.shape[2], fp8=w13.dtype == _FP8, device=counts.device,
                         family="expert_major", use_model=policy != "default")
