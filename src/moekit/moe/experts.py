"""SwiGLU experts stored as stacked weights, and the random weights of a whole MoE block."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from moekit.ep.dispatcher import EXPERT_MAJOR, TOKEN_MAJOR
from moekit.fp8 import FP8_DTYPE, dequantize_groups
from moekit.shapes import MoEShape


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, where h = [gate | up] along the last dimension."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert on rows x[..., H]: w13 is [2N, H], w2 is [H, N]."""
    return swiglu(x @ w13.t()) @ w2.t()


@dataclass
class MoEWeights:
    """All weights of one MoE block: router [E, H], w13 [E, 2N, H], w2 [E, H, N], and the
    shared experts fused into one SwiGLU MLP (shared_w13 [2S, H], shared_w2 [H, S] with
    S = num_shared * shared_intermediate), or None."""

    router: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    shared_w13: torch.Tensor | None = None
    shared_w2: torch.Tensor | None = None

    @classmethod
    def random(cls, shape: MoEShape, *, seed: int = 0, dtype=torch.float32, device="cpu") -> "MoEWeights":
        """Reproducible random weights, scaled so activations keep unit-order magnitude.

        Drawn on the CPU in float64 from ``seed`` and then cast, so every rank and every
        device gets the same numbers.
        """
        g = torch.Generator().manual_seed(seed)
        H, N, E = shape.hidden, shape.intermediate, shape.num_experts

        def draw(*size, fan_in):
            w = torch.randn(*size, generator=g, dtype=torch.float64) * fan_in**-0.5
            return w.to(device=device, dtype=dtype)

        # The router is float32 whatever ``dtype`` (routing must not depend on it).
        router = (torch.randn(E, H, generator=g, dtype=torch.float64) * H**-0.5).to(device=device, dtype=torch.float32)
        w13, w2 = draw(E, 2 * N, H, fan_in=H), draw(E, H, N, fan_in=N)
        shared_w13 = shared_w2 = None
        if shape.num_shared_experts:
            S = shape.num_shared_experts * shape.shared_intermediate
            shared_w13, shared_w2 = draw(2 * S, H, fan_in=H), draw(H, S, fan_in=S)
        return cls(router, w13, w2, shared_w13, shared_w2)

    def to(self, dtype=None, device=None) -> "MoEWeights":
        """A copy with the expert weights cast (the router stays float32 unless dtype is float64)."""
        def cast(t):
            return None if t is None else t.to(device=device, dtype=dtype)
        router_dtype = torch.float64 if dtype == torch.float64 else (None if dtype is None else torch.float32)
        return MoEWeights(self.router.to(device=device, dtype=router_dtype), cast(self.w13),
                          cast(self.w2), cast(self.shared_w13), cast(self.shared_w2))


def check_expert_weights(w13: torch.Tensor, w2: torch.Tensor) -> None:
    """Stacked SwiGLU expert weights: w13 [E, 2N, H] and w2 [E, H, N] that agree on E, N and H."""
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[0] != w2.shape[0]:
        raise ValueError(f"w13 must be [E, 2N, H] and w2 [E, H, N], got {tuple(w13.shape)} and {tuple(w2.shape)}")
    if w13.shape[1] != 2 * w2.shape[2] or w13.shape[2] != w2.shape[1]:
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} disagree on H or N")


def check_expert_tokens(tokens: torch.Tensor, scales: torch.Tensor | None, num_experts: int, hidden: int) -> None:
    """A Dispatcher's received tokens [E_local, capacity, H]; FP8 tokens come with their group
    scales [E_local, capacity, H / group] (and only FP8 tokens do)."""
    if tokens.dim() != 3 or tokens.shape[0] != num_experts or tokens.shape[2] != hidden:
        raise ValueError(f"tokens must be [E_local={num_experts}, capacity, H={hidden}], got {tuple(tokens.shape)}")
    if tokens.dtype == FP8_DTYPE:
        if scales is None:
            raise ValueError(f"scales are required with {FP8_DTYPE} tokens: float32 [E_local, capacity, H / group]")
        if scales.dim() != 3 or scales.shape[:2] != tokens.shape[:2] or not scales.shape[2] \
                or hidden % scales.shape[2]:
            raise ValueError(f"scales {tuple(scales.shape)} do not tile tokens {tuple(tokens.shape)} in groups")
    elif scales is not None:
        raise ValueError(f"scales are only for {FP8_DTYPE} tokens; the tokens are {tokens.dtype}")


class SwiGLUExperts(nn.Module):
    """The experts of one rank in plain torch, on either layout a Dispatcher delivers.

    Expert-major: ``forward(tokens[E_local, capacity, H], counts[E_local], scales=None)`` ->
    [E_local, capacity, H] in the weights' dtype. Rows at or past ``counts[e]`` are padding;
    their outputs are unspecified and no combine reads them.

    Token-major (one process): ``token_major(x[T, H], topk_ids[T, K], topk_weights, scales=None)``
    -> the slot outputs [T, K, H] (unweighted: ``sums_slots`` is False, the dispatcher's combine
    weights and sums them in its order); masked slots (id -1) give zero rows.

    FP8 tokens (a quantizing dispatcher's) come with their per-group ``scales`` and are
    dequantized first. This is the plain-torch expert compute (batched matmuls);
    :class:`moekit.moe.FusedExperts` runs the fused Triton kernel.
    """

    layouts = (EXPERT_MAJOR, TOKEN_MAJOR)
    sums_slots = False

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor):
        super().__init__()
        check_expert_weights(w13, w2)
        self.w13 = nn.Parameter(w13, requires_grad=False)
        self.w2 = nn.Parameter(w2, requires_grad=False)

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor | None = None,
                scales: torch.Tensor | None = None) -> torch.Tensor:
        check_expert_tokens(tokens, scales, self.num_experts, self.w13.shape[2])
        if scales is not None:
            tokens = dequantize_groups(tokens, scales, self.w13.dtype)
        return self.compute(tokens.to(self.w13.dtype))

    def compute(self, tokens: torch.Tensor) -> torch.Tensor:
        """The experts on validated tokens [E_local, capacity, H] in the weights' dtype."""
        return swiglu_expert_major(tokens, self.w13, self.w2)

    def token_major(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None = None,
                    scales: torch.Tensor | None = None) -> torch.Tensor:
        """The slot outputs [T, K, H] of tokens ``x`` [T, H] (see the class docstring)."""
        if scales is not None:
            x = dequantize_groups(x, scales, self.w13.dtype)
        return swiglu_token_major(x.to(self.w13.dtype), topk_ids, self.w13, self.w2)


def swiglu_expert_major(tokens: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """SwiGLU expert e on every row of ``tokens[e]`` [E, capacity, H] (batched matmuls)."""
    h = torch.bmm(tokens, w13.transpose(1, 2))
    return torch.bmm(swiglu(h), w2.transpose(1, 2))


def swiglu_token_major(x: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The slot outputs [T, K, H]: SwiGLU expert ``topk_ids[t, k]`` on ``x[t]``, zero rows where
    the slot is masked (-1).

    The pairs are sorted by expert (masked ones last) and each expert's rows run as one group
    (``grouped_mm`` where torch offers it for these dtypes and sizes, else a loop over the
    experts that masks the rows of the others), so nothing is read back to the host.
    """
    T, K = topk_ids.shape
    E, H = w13.shape[0], w13.shape[2]
    ids = topk_ids.reshape(-1).to(torch.int64)
    keyed = torch.where(ids >= 0, ids, E)  # masked pairs sort after every expert
    order = torch.argsort(keyed, stable=True)
    rows = x[torch.div(order, K, rounding_mode="floor")] if K else x[:0]
    per_expert = torch.zeros(E + 1, dtype=torch.int64, device=x.device).scatter_add_(0, keyed, torch.ones_like(keyed))
    ends = torch.cumsum(per_expert[:E], 0).to(torch.int32)
    out_sorted = _grouped_swiglu(rows, w13, w2, ends, keyed[order])
    kept = torch.where((keyed[order] < E).unsqueeze(1), out_sorted, torch.zeros_like(out_sorted))
    out = torch.zeros(T * K, H, dtype=out_sorted.dtype, device=x.device).index_copy(0, order, kept)
    return out.view(T, K, H)


def _grouped_swiglu(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ends: torch.Tensor,
                    experts: torch.Tensor) -> torch.Tensor:
    """SwiGLU expert ``experts[i]`` on each row of ``rows`` (sorted by expert; ``ends`` are the
    cumulative row counts per expert). Rows of masked pairs (expert E) give unspecified values."""
    if _grouped_mm_fits(rows, w13, w2):
        h = torch.nn.functional.grouped_mm(rows, w13.transpose(1, 2), offs=ends)
        return torch.nn.functional.grouped_mm(swiglu(h), w2.transpose(1, 2), offs=ends)
    out = torch.zeros(rows.shape[0], w2.shape[1], dtype=rows.dtype, device=rows.device)
    for e in range(w13.shape[0]):  # every expert on every row, kept where the row is its own
        mine = (experts == e).unsqueeze(1)
        out = torch.where(mine, expert_mlp(rows, w13[e], w2[e]), out)
    return out


def _grouped_mm_fits(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether torch's grouped matmul takes these operands everywhere (eager on either device
    and traced by torch.compile, whose shape function is the strictest): bfloat16 operands with
    16-byte aligned strides."""
    if not hasattr(torch.nn.functional, "grouped_mm") or rows.shape[0] == 0 or rows.dtype != torch.bfloat16:
        return False
    per16 = 16 // rows.element_size()
    return all(d % per16 == 0 for d in (w13.shape[1], w13.shape[2], w2.shape[2]))
