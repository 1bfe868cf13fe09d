"""The blocks ``moekit tax --measure`` times, and their references (the MoE tax, section 5.3).

* The **MoE block**: router (float32 gate matmul + a per-expert bias that sets the skew,
  softmax, top-k), the fused expert kernel ``moekit.kernels.fused_moe`` and the shared experts
  as one dense SwiGLU FFN (:func:`moe_block`).
* **DenseFA** and **DensePA**: one SwiGLU FFN of intermediate K*N + S and E*N + S (S = the
  shared width), the FLOP-aligned and parameter-aligned dense equivalents
  (:func:`dense_intermediates`; plain torch matmuls through ``moekit.moe.experts.expert_mlp``).

Weights are random with fan-in scaling, drawn on the device; each block is checked against an
independent reference (``reference_moe`` in float64 on the CPU; a float64 SwiGLU written out
step by step for the dense blocks). :func:`block_memory` sizes a block for the memory check.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from moekit.moe.experts import MoEWeights, expert_mlp
from moekit.moe.reference import reference_moe
from moekit.moe.router import softmax_topk
from moekit.routing.stats import balancedness, expert_counts
from moekit.shapes import MoEShape

VERIFY_ROWS = 32  # tokens of the first input set checked against the reference


def elem_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def dense_intermediates(shape: MoEShape) -> dict[str, int]:
    """Intermediate widths of the dense equivalents (the MoE-tax paper, section 2, plus shared experts):
    DenseFA K*N + S (same activated parameters), DensePA E*N + S (same total parameters)."""
    s = shape.num_shared_experts * shape.shared_intermediate
    return {"densefa": shape.top_k * shape.intermediate + s, "densepa": shape.num_experts * shape.intermediate + s}


def block_memory(shape: MoEShape, kind: str, m: int, elem: int, graphs: int) -> int:
    """Bytes one block kind needs at batch m: weights plus ``graphs`` copies of its
    activations (each captured graph keeps its own). Generous estimate, for the check."""
    h, n, e, k = shape.hidden, shape.intermediate, shape.num_experts, shape.top_k
    s = shape.num_shared_experts * shape.shared_intermediate
    if kind == "moe":
        weights = 3 * h * (e * n + s) * elem + 4 * e * h
        cap = m * k + min(e, m * k) * 127  # the largest token block (bm = 128)
        act = cap * n * elem + m * h * (4 + 4 * elem) + 16 * m * e + 3 * m * s * elem + 24 * m * k
    else:
        width = dense_intermediates(shape)[kind]
        weights = 3 * h * width * elem
        act = 4 * m * width * elem + 2 * m * h * elem
    return weights + graphs * act


def check_memory(shape: MoEShape, batch_sizes: Iterable[int], elem: int, graphs: int, limit: int) -> None:
    """ValueError (naming the block, m and sizes) if a block kind would not fit in ``limit``.

    Block kinds are timed one after another (their weights are freed in between), so each
    must fit on its own.
    """
    m = max(batch_sizes)
    for kind in ("moe", "densefa", "densepa"):
        need = block_memory(shape, kind, m, elem, graphs)
        if need > limit:
            raise ValueError(
                f"{shape.name} {kind} at m={m} needs about {need / 2**30:.1f} GiB "
                f"(weights + {graphs} graphs' activations) but only {limit / 2**30:.1f} GiB are available; "
                "use smaller batch_sizes or fewer input_sets")


def _randn(shape, fan_in: int, dtype, device, gen) -> torch.Tensor:
    """Random weights of unit-order outputs (fan-in scaling), drawn on the device."""
    if device.type == "cuda":
        w = torch.randn(*shape, generator=gen, device=device, dtype=dtype)
        return w.mul_(fan_in**-0.5)
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * fan_in**-0.5).to(dtype)


def make_moe_weights(shape: MoEShape, dtype, device, seed: int):
    """Router (float32, as moekit's TopKRouter), stacked experts and fused shared experts."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h, n, e = shape.hidden, shape.intermediate, shape.num_experts
    router = _randn((e, h), h, torch.float32, device, gen)
    w13, w2 = _randn((e, 2 * n, h), h, dtype, device, gen), _randn((e, h, n), n, dtype, device, gen)
    sw13 = sw2 = None
    s = shape.num_shared_experts * shape.shared_intermediate
    if s:
        sw13, sw2 = _randn((2 * s, h), h, dtype, device, gen), _randn((h, s), s, dtype, device, gen)
    return MoEWeights(router, w13, w2, sw13, sw2)


def make_dense_weights(shape: MoEShape, kind: str, dtype, device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [2I, H] and w2 [H, I] of DenseFA or DensePA."""
    gen = torch.Generator(device=device).manual_seed(seed)
    width, h = dense_intermediates(shape)[kind], shape.hidden
    return _randn((2 * width, h), h, dtype, device, gen), _randn((h, width), width, dtype, device, gen)


def route(x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor, top_k: int):
    """float32 gate logits (+ a per-expert bias that sets the skew), softmax, top-k."""
    logits = x.to(torch.float32) @ router.t() + bias
    return softmax_topk(logits, top_k, renormalize=True)


def moe_block(x, bias, weights, top_k: int, config, kernels) -> torch.Tensor:
    """The timed MoE FFN block: route, fused experts, plus the shared experts."""
    ids, tw = route(x, weights.router, bias, top_k)
    y = kernels.fused_moe(x, weights.w13, weights.w2, ids, tw, config)
    if weights.shared_w13 is not None:
        y = y + expert_mlp(x, weights.shared_w13, weights.shared_w2)
    return y


def skew_bias(logits: Sequence[torch.Tensor], top_k: int, beta: float | None, seed: int) -> tuple[torch.Tensor, float]:
    """A per-expert logit bias s * log(1/rank) (a Zipf popularity over a random expert order)
    whose routing of ``logits`` (all input sets together) has balancedness ~ ``beta``.

    beta None: zero bias (the random router is close to uniform). Bisection on s, as
    ``synthetic_routing`` does on its exponent. Returns (bias [E] float32, realized beta).
    """
    e = logits[0].shape[1]
    device = logits[0].device
    stacked = torch.cat(list(logits))

    def realized(bias: torch.Tensor) -> float:
        ids = torch.topk(stacked + bias, top_k, dim=-1).indices.cpu().numpy()
        return float(balancedness(expert_counts(ids, e)))

    zero = torch.zeros(e, dtype=torch.float32, device=device)
    if beta is None:
        return zero, realized(zero)
    perm = np.random.default_rng(seed).permutation(e) + 1
    profile = torch.tensor(-np.log(perm), dtype=torch.float32, device=device)
    lo, hi = 0.0, 1.0
    for _ in range(30):  # bracket: grow s until the routing is skewed enough
        if realized(hi * profile) <= beta:
            break
        lo, hi = hi, 2 * hi
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if realized(mid * profile) > beta else (lo, mid)
    bias = hi * profile
    return bias, realized(bias)


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.to(torch.float64) - ref.to(torch.float64)).norm() / ref.to(torch.float64).norm().clamp_min(1e-30))


def _verify_moe(x, weights, bias, routed, shape, cfg, kernels) -> float:
    """Relative error of the timed MoE block on the first VERIFY_ROWS tokens of set 0 against
    ``reference_moe`` (float64 on the CPU, float32 on the GPU, where float64 weights of a
    whole expert would be large), with the routing the block computed."""
    y = moe_block(x, bias, weights, shape.top_k, cfg, kernels)
    r = min(VERIFY_ROWS, x.shape[0])
    ref_dtype = torch.float64 if x.device.type == "cpu" else torch.float32
    ref = reference_moe(x[:r], weights, routed[0][:r], routed[1][:r], dtype=ref_dtype)
    return _rel_err(y[:r], ref)


def _verify_dense(x, w13, w2) -> float:
    """Relative error of a dense block on a few tokens against a float64 computation
    written out step by step."""
    r = min(VERIFY_ROWS, x.shape[0])
    y = expert_mlp(x, w13, w2)[:r]
    xr = x[:r].to(torch.float64)
    h = xr @ w13.to(torch.float64).t()
    gate, up = h[:, : h.shape[1] // 2], h[:, h.shape[1] // 2:]
    ref = (gate * torch.sigmoid(gate) * up) @ w2.to(torch.float64).t()
    return _rel_err(y, ref)


def run_device(asked: str | None) -> tuple[torch.device, bool]:
    """(device, on a GPU) of a tax run: ``asked`` (cpu, cuda or cuda:N), else CUDA when there is
    one; a bare "cuda" becomes the current device, so records name the card."""
    if asked is not None:
        device = torch.device(asked)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={asked!r} was asked for but CUDA is not available")
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be cuda or cpu, got {device}")
    on_gpu = device.type == "cuda"
    if on_gpu and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device, on_gpu
