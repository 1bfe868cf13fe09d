"""The experts of one rank through the fused Triton kernel (``moekit.kernels``).

A drop-in for :class:`~moekit.moe.experts.SwiGLUExperts` in :class:`~moekit.moe.MoELayer`
(``experts="fused"`` / ``"fused_fp8"``): same call on a Dispatcher's expert-major layout,
one kernel family for the up-projection, SwiGLU and the down-projection.

``moekit.kernels`` is imported when the first instance is built, not with this module: its
kernels are decorated at import, and on a machine without a GPU that has to happen under
Triton's interpreter (``TRITON_INTERPRET=1``), which the caller sets.
"""

from __future__ import annotations

import torch
from torch import nn

from moekit.fp8 import FP8_DTYPE, dequantize_groups, quantize_blocks
from moekit.moe.experts import check_expert_tokens, check_expert_weights

CONFIG_MODES = ("ramp", "auto", "default")  # FusedExperts(config=...) besides a KernelConfig
FP8_BLOCK = 128  # weight scale blocks (128 x 128) and activation groups (1 x 128) of the W8A8 kernel


class FusedExperts(nn.Module):
    """``forward(tokens[E_local, capacity, H], counts[E_local], scales=None)`` ->
    ``[E_local, capacity, H]`` in the dtype of the weights as given.

    Row r of expert e is expert_e(tokens[e, r]) for r < counts[e] (unweighted: the
    dispatcher's combine applies the routing weights in slot order). Rows past counts[e] are
    unspecified, as the dispatcher's own rows there: no combine reads them, and the kernel
    runs only the blocks the counts name (``moekit.kernels.expert_major``).

    * ``fp8=False``: the bf16 / fp16 / fp32 kernel on weights in their dtype. FP8 tokens (a
      quantizing dispatcher's) are dequantized with their ``scales`` first, since this kernel
      takes tokens and weights in one dtype.
    * ``fp8=True``: W8A8 with block scales. The weights are quantized once, here, to e4m3 in
      128 x 128 blocks (:func:`moekit.fp8.quantize_blocks`); FP8 tokens go into the kernel
      with their scales as they are (no dequantize/requantize round trip), other tokens are
      quantized per 128 columns by the kernel's prologue. H and N must be multiples of 128.

    ``config``:

    * ``"ramp"`` (or None, the default): on a GPU with a fitted RaMP model of this shape
      (:mod:`moekit.ramp`; shipped or in ``MOEKIT_RAMP_MODELS``), the model's choice for the
      capacity, reading the counts (one host read per step, shared by every ``FusedExperts``)
      only at capacities where the model predicts the read saves more than it costs
      (:func:`moekit.ramp.select.ramp_config_expert_major`); without a model, or off the GPU,
      the kernel's static default. No host read inside a CUDA-graph capture.
    * ``"auto"``: RaMP reads the counts every step (one host read per forward step, shared by
      every ``FusedExperts`` of the step: the per-step cache, this module the layer key); without
      a model the region-analysis fallback, with a one-time warning. Inside a CUDA-graph capture,
      and at the first call of a capacity, the static choice for the capacity, with no host
      read, so the call can be captured after one warm-up call.
    * ``"default"``: the kernel's static default for the capacity (never reads the host).
    * A :class:`moekit.kernels.KernelConfig`: that one (FP8-valid when ``fp8``).

    ``last_config``: the configuration the last call ran.
    """

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, *, config=None, fp8: bool = False):
        super().__init__()
        check_expert_weights(w13, w2)
        from moekit import kernels  # see the module docstring

        if not kernels.HAVE_TRITON:
            raise RuntimeError("FusedExperts needs Triton: pip install 'moekit[triton]'")
        config = "ramp" if config is None else config
        if not (isinstance(config, kernels.KernelConfig) or (isinstance(config, str) and config in CONFIG_MODES)):
            raise ValueError(f"config must be a moekit.kernels.KernelConfig, one of {CONFIG_MODES} or None, "
                             f"got {config!r}")
        if not isinstance(fp8, bool):
            raise ValueError(f"fp8 must be a bool, got {fp8!r}")
        self._kernel = kernels.fused_moe_expert_major
        self._default = kernels.expert_major_default
        self.config = config
        self.last_config = None
        self.fp8 = fp8
        self.out_dtype = w13.dtype
        if fp8:
            H, N = w2.shape[1], w2.shape[2]
            if H % FP8_BLOCK or N % FP8_BLOCK:
                raise ValueError(f"fp8=True needs H and N to be multiples of {FP8_BLOCK}, got H={H}, N={N}")
            (w13, w13_scale), (w2, w2_scale) = quantize_blocks(w13, FP8_BLOCK), quantize_blocks(w2, FP8_BLOCK)
            self.register_buffer("w13_scale", w13_scale)
            self.register_buffer("w2_scale", w2_scale)
        else:
            self.w13_scale = self.w2_scale = None
        self.register_buffer("w13", w13.contiguous())
        self.register_buffer("w2", w2.contiguous())

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
        check_expert_tokens(tokens, scales, self.num_experts, self.w13.shape[2])
        config = self._config_for(counts, tokens.shape[1])
        if self.fp8:
            if tokens.dtype != FP8_DTYPE:  # the kernel's prologue quantizes them
                tokens, scales = tokens.to(self.out_dtype), None
            out = self._kernel(tokens, counts, self.w13, self.w2, config, w13_scale=self.w13_scale,
                               w2_scale=self.w2_scale, token_scales=scales)
        else:
            if scales is not None:
                tokens = dequantize_groups(tokens, scales, self.out_dtype)
            out = self._kernel(tokens.to(self.out_dtype), counts, self.w13, self.w2, config)
        return out.to(self.out_dtype)

    def _config_for(self, counts: torch.Tensor, capacity: int):
        # Malformed counts are the kernel's to report; an empty layout runs nothing.
        usable = capacity > 0 and counts.dim() == 1 and counts.shape[0] == self.num_experts
        config = None
        if self.config == "auto" and usable:  # imported here: moekit.ramp imports the kernels
            from moekit.ramp.select import auto_config_expert_major

            config = auto_config_expert_major(counts, capacity, self.w13, self.w2, layer=id(self))
        elif self.config == "ramp" and usable and counts.is_cuda:
            from moekit.ramp.select import ramp_config_expert_major

            config = ramp_config_expert_major(counts, capacity, self.w13, self.w2, layer=id(self))
        elif not isinstance(self.config, str):
            config = self.config
        if config is None:
            config = self._default(capacity, self.fp8)
        self.last_config = config
        return config
