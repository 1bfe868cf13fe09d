"""The experts of one rank through the fused Triton kernel (``moekit.kernels``).

A drop-in for :class:`~moekit.moe.experts.SwiGLUExperts` in :class:`~moekit.moe.MoELayer`
(``experts="fused"`` / ``"fused_fp8"``): the same calls on either layout a Dispatcher
delivers, one kernel family for the up-projection, SwiGLU and the down-projection.

``moekit.kernels`` is imported when the first instance is built, not with this module: its
kernels are decorated at import, and on a machine without a GPU that has to happen under
Triton's interpreter (``TRITON_INTERPRET=1``), which the caller sets.
"""

from __future__ import annotations

import torch
from torch import nn

from moekit.ep.dispatcher import EXPERT_MAJOR, TOKEN_MAJOR
from moekit.fp8 import FP8_DTYPE, dequantize_groups, quantize_blocks
from moekit.moe.experts import check_expert_tokens, check_expert_weights

CONFIG_MODES = ("static", "default", "ramp", "auto")  # FusedExperts(config=...) besides a KernelConfig
FP8_BLOCK = 128  # weight scale blocks (128 x 128) and activation groups (1 x 128) of the W8A8 kernel


class FusedExperts(nn.Module):
    """The experts of one rank through the fused Triton kernels, on either layout.

    Token-major (one process, :class:`~moekit.ep.local.LocalDispatcher`):
    ``token_major(x[T, H], topk_ids[T, K], topk_weights[T, K], scales=None)`` -> ``[T, H]``, the
    routing weights applied and the K slots summed in the kernel (``sums_slots``: the
    dispatcher's combine only finalizes). One call of the token-major kernel
    (:func:`moekit.ops.fused_moe`): no regrouping of the activations, nothing read back.

    Expert-major (the multi-rank dispatchers): ``forward(tokens[E_local, capacity, H],
    counts[E_local], scales=None)`` -> ``[E_local, capacity, H]``. Row r of expert e is
    expert_e(tokens[e, r]) for r < counts[e] (unweighted: the dispatcher's combine applies the
    routing weights in its order). Rows past counts[e] are unspecified, as the dispatcher's own
    rows there: no combine reads them, and the kernel runs only the blocks the counts name.

    Both return the dtype of the weights as given.

    * ``fp8=False``: the bf16 / fp16 / fp32 kernel on weights in their dtype. FP8 tokens (a
      quantizing dispatcher's) are dequantized with their ``scales`` first, since this kernel
      takes tokens and weights in one dtype.
    * ``fp8=True``: W8A8 with block scales. The weights are quantized once, here, to e4m3 in
      128 x 128 blocks (:func:`moekit.fp8.quantize_blocks`); FP8 tokens go into the kernel
      with their scales as they are (no dequantize/requantize round trip), other tokens are
      quantized per 128 columns by the kernel's prologue. H and N must be multiples of 128.

    ``config``: how the kernel's configuration is chosen (:mod:`moekit.ops.policy`):
    ``"static"`` (or None, the default: one config per token-count bucket, never reading the
    routing), ``"default"`` (the kernels' own static pick), ``"ramp"`` (RaMP where a model
    ships, reading the routing only where the model predicts it pays), ``"auto"`` (RaMP reads
    the routing once per step), or a :class:`moekit.kernels.KernelConfig` (FP8-valid when
    ``fp8``). Inside a CUDA-graph capture RaMP's policies run the static choice.
    ``last_config``: the configuration the last eager call ran.

    The kernels have no backward: with gradients enabled and a weight or input that requires
    one, the output carries a backward that raises, so a loss through the experts fails at
    ``backward()`` instead of leaving them without a gradient.
    """

    layouts = (EXPERT_MAJOR, TOKEN_MAJOR)
    sums_slots = True

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, *, config=None, fp8: bool = False,
                 top_k: int | None = None):
        super().__init__()
        check_expert_weights(w13, w2)
        from moekit import kernels, ops  # see the module docstring

        if not kernels.HAVE_TRITON:
            raise RuntimeError("FusedExperts needs Triton: pip install 'moekit[triton]'")
        self.config = ops.check_policy(config)
        if not isinstance(fp8, bool):
            raise ValueError(f"fp8 must be a bool, got {fp8!r}")
        self._ops = ops
        self._static: dict[int, object] = {}
        self.last_config = None
        self.top_k = top_k
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

    def _kernel_inputs(self, a: torch.Tensor, scales: torch.Tensor | None):
        """(activations, scales) as the kernel takes them: FP8 tokens with their scales into the
        W8A8 kernel (others in the weights' dtype: its prologue quantizes them); for the 16/32-bit
        kernel, FP8 tokens dequantized first."""
        if self.fp8:
            return (a, scales) if a.dtype == FP8_DTYPE else (a.to(self.out_dtype), None)
        if scales is not None:
            a = dequantize_groups(a, scales, self.out_dtype)
        return (a if a.dtype == self.out_dtype else a.to(self.out_dtype)), None

    def token_major(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    scales: torch.Tensor | None = None) -> torch.Tensor:
        """``[T, H]``: the K slots of every token weighted and summed (see the class docstring)."""
        given = x
        x, scales = self._kernel_inputs(x, scales)
        held = self._buffers  # (read directly: this is the hot path of every patched experts call)
        w13, w2 = held["w13"], held["w2"]
        config = self.config
        if not torch.compiler.is_compiling():  # compiled, the operator resolves the policy itself
            # The static policy's answer per token count, kept here: one dict lookup per call.
            config = self._static.get(topk_ids.shape[0]) if config == "static" else None
            if config is None:
                config = self._ops.policy.token_config(self.config, topk_ids, w13, w2, layer=id(self))
                if self.config == "static" and len(self._static) < 4096:
                    self._static[topk_ids.shape[0]] = config
            self.__dict__["last_config"] = config
        out = self._ops.fused_moe(x, w13, w2, topk_ids, topk_weights, config,
                                  w13_scale=held.get("w13_scale"), w2_scale=held.get("w2_scale"), x_scale=scales)
        out = out if out.dtype == self.out_dtype else out.to(self.out_dtype)
        return _guard_backward(out, given, w13)

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
        check_expert_tokens(tokens, scales, self.num_experts, self.w13.shape[2])
        given = tokens
        tokens, scales = self._kernel_inputs(tokens, scales)
        config = self.config
        if not torch.compiler.is_compiling():
            config = self._ops.policy.expert_major_config(config, counts, tokens.shape[1], self.w13, self.w2,
                                                          top_k=self.top_k, layer=id(self))
            self.last_config = config
        out = self._ops.fused_moe_expert_major(tokens, counts, self.w13, self.w2, config,
                                               w13_scale=self.w13_scale, w2_scale=self.w2_scale,
                                               token_scales=scales)
        return _guard_backward(out.to(self.out_dtype), given, self.w13)


class _RefuseBackward(torch.autograd.Function):
    """Identity forward; a backward that raises (the fused kernels have none), so a loss
    through them fails at ``backward()`` instead of leaving the experts without a gradient."""

    @staticmethod
    def forward(ctx, out, *inputs):
        return out.view_as(out)

    @staticmethod
    def backward(ctx, *grads):
        from moekit.ops.library import NO_BACKWARD

        raise RuntimeError(NO_BACKWARD)


def _guard_backward(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return _RefuseBackward.apply(out, x, w)
    return out
