"""RaMP's performance regions: what a fused-MoE configuration launches for an expert histogram.

Everything here follows from the shape, a :class:`~moekit.kernels.KernelConfig`, the expert
histogram and hardware constants alone -- no timing. It gives

* the **CTA grid** of every launch of one call (:func:`grid_plan`, :func:`grids`): the RaMP
  paper's Eq. 1, ``G = sum_e ceil(n_e / bm) * N-tiles * split_k``, per launch of this kernel
  (two_launch runs GEMM1 and GEMM2; the fused form one launch; the decode schedule one
  persistent launch whose two phases walk work units), each with its resident slots ``S``
  (CTAs the SMs hold at once);
* the four **region variables** (:func:`region_variables`): compute density ``rho`` (64^3 tile
  MMAs per CTA of GEMM1), L2 pressure ``lam`` (one expert's GEMM1 weights over the L2 share
  that holds weights), wave utilization ``omega = G / S`` (the only routing-dependent one) and
  K-reduction depth ``kappa`` (the chunks of the reduction that split-K divides);
* the **predicted modes** of a shape (:func:`predict_modes`): tile only, + GROUP_M, + split-K,
  small token blocks under skew.

The grid mirrors the kernels' launch code (``moekit.kernels.launch.run_blocks`` and
``run_persistent``, ``moekit.kernels.expert_major._run_stored``): direct addressing when
``M <= bm`` (one block per named expert), the alignment's blocks otherwise; blocks past the
real count exit at once and are not counted. The launch choices (CTAs per SM, reduction
shares) are the kernels' default ``LaunchPlan``, :data:`KERNEL_PLAN`.

Where the paper's copy lost a symbol or a threshold, the choice made here is in docs/ramp.md.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from moekit.kernels.configs import HOPPER_SMEM_PER_BLOCK, KernelConfig
from moekit.kernels.plan import LaunchPlan as KernelLaunchPlan
from moekit.shapes import MoEShape

FAMILIES = ("token", "expert_major")  # fused_moe after a router; fused_moe_expert_major after a dispatcher
TOKEN_BLOCKS = (16, 32, 64, 128)

# The kernels' own launch choices (their defaults): the grids below follow them.
KERNEL_PLAN = KernelLaunchPlan()

# Registers of a CTA's thread besides its fp32 accumulators (addresses, pipelined operand
# fragments, loop state). An estimate: the compiled kernel's count is only known on the GPU.
REG_OVERHEAD = 64
SYSTEM_SMEM_PER_CTA = 1024  # the shared memory the driver reserves per CTA (sm_80+)

# The paper's thresholds, reconstructed where its copy lost them (docs/ramp.md):
L2_WEIGHT_FRACTION = 0.75  # "72-78 % of L2 sectors available for weights"
KAPPA_MIN = 32  # split-K needs at least this many reduction chunks (16 no, 48-56 yes in its Table III)
SMALL_BM_WASTE = 0.5  # small token blocks are predicted where >= half of 64-row blocks is padding


@dataclass(frozen=True)
class Hardware:
    """The constants of a GPU the region analysis uses.

    ``key`` names the GPU in model files (``h100``, ``h200``, or a slug of the device name).
    """

    key: str
    sms: int
    l2_bytes: int
    smem_per_sm: int
    smem_per_block: int = HOPPER_SMEM_PER_BLOCK
    regs_per_sm: int = 65536
    max_threads_per_sm: int = 2048
    max_ctas_per_sm: int = 32
    hbm_gbps: float = 0.0  # nominal, for the fallback's time estimate
    bf16_tflops: float = 0.0

    @property
    def l2_effective(self) -> float:
        """The bytes of L2 that hold weights (the paper's effective L2)."""
        return L2_WEIGHT_FRACTION * self.l2_bytes

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


MIB = 1 << 20
HARDWARE = {
    # H100 SXM: 50 MiB L2, 3.35 TB/s HBM3; H200: 60 MiB L2, 4.8 TB/s HBM3e. Both 132 SMs with
    # 228 KB shared memory each (227 KB for one block). Rates: the measured ones of
    # docs/foundation.md (copy ~3.0 / ~4.3 TB/s, bf16 matmul ~790 TFLOP/s).
    "h100": Hardware("h100", 132, 50 * MIB, 228 * 1024, hbm_gbps=3000.0, bf16_tflops=790.0),
    "h200": Hardware("h200", 132, 60 * MIB, 228 * 1024, hbm_gbps=4300.0, bf16_tflops=790.0),
}


def gpu_key(name: str) -> str:
    """``h100`` / ``h200`` for those GPUs (any form factor), else a slug of ``name``."""
    low = name.lower()
    for key in ("h200", "h100"):
        if key in low:
            return key
    return re.sub(r"[^a-z0-9]+", "-", low).strip("-") or "unknown"


def hardware_for(gpu: str | None = None, device: torch.device | str | None = None) -> Hardware:
    """The constants of ``gpu`` (``h100`` / ``h200``), or of CUDA ``device`` read from its
    properties, or the H200's when neither is given and no GPU is present."""
    if gpu is not None:
        key = gpu.lower()
        if key not in HARDWARE:
            raise ValueError(f"gpu must be one of {', '.join(HARDWARE)}, got {gpu!r}")
        return HARDWARE[key]
    if device is not None:
        device = torch.device(device)
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if device is None or device.type != "cuda":
        return HARDWARE["h200"]
    props = torch.cuda.get_device_properties(device)
    key = gpu_key(props.name)
    nominal = HARDWARE.get(key)
    return Hardware(
        key, props.multi_processor_count, int(getattr(props, "L2_cache_size", 0) or (nominal or HARDWARE["h200"]).l2_bytes),
        int(getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)),
        int(getattr(props, "shared_memory_per_block_optin", 0) or HOPPER_SMEM_PER_BLOCK),
        int(getattr(props, "regs_per_multiprocessor", 65536)),
        int(getattr(props, "max_threads_per_multi_processor", 2048)),
        hbm_gbps=nominal.hbm_gbps if nominal else 0.0, bf16_tflops=nominal.bf16_tflops if nominal else 0.0)


# ------------------------------------------------------------------------- occupancy


def resident_per_sm(smem_bytes: int, acc_regs: int, num_warps: int, hw: Hardware) -> int:
    """CTAs of a kernel that one SM holds at once, from its shared memory, an estimate of its
    registers (``acc_regs`` fp32 accumulator registers per thread + :data:`REG_OVERHEAD`,
    at most 255) and its threads. At least 1.

    On the GPU the compiled kernel's own numbers decide (``moekit.kernels.occupancy``); this
    estimate is what the model uses everywhere so that a model file means the same thing on
    any machine."""
    by_smem = hw.smem_per_sm // (smem_bytes + SYSTEM_SMEM_PER_CTA)
    regs = min(255, acc_regs + REG_OVERHEAD)
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = hw.regs_per_sm // per_warp // num_warps
    by_threads = hw.max_threads_per_sm // (32 * num_warps)
    return max(1, min(by_smem, by_regs, by_threads, hw.max_ctas_per_sm))


def _gemm1_footprint(c: KernelConfig, elem: int) -> tuple[int, int]:
    """(shared memory bytes, accumulator registers per thread) of GEMM1 (or the fused form)."""
    smem = c.num_stages * (c.bm * c.bk + 2 * c.bn * c.bk) * elem
    acc = 2 * c.bm * c.bn
    if c.form == "fused":
        smem += (c.bk * c.bn + c.bm * c.bn) * elem * 2
        acc += c.bm * c.bk
    return smem, acc // (32 * c.num_warps)


def _gemm2_footprint(c: KernelConfig, elem: int) -> tuple[int, int]:
    smem = c.num_stages * (c.bm * c.bk + c.gemm2_bn * c.bk) * elem
    return smem, c.bm * c.gemm2_bn // (32 * c.num_warps)


# ------------------------------------------------------------------------------ grids


@dataclass(frozen=True)
class Launch:
    """One launch (or one phase of a persistent launch) of a call, as a function of the
    histogram's token blocks ``x = sum_e ceil(n_e / bm)``.

    ``G(x) = x * per_block * splits(x)``: CTAs (or work units) with work. ``splits(x)`` is 1
    unless ``split_fill`` > 0: the persistent decode kernel splits each GEMM1 tile's reduction
    into ``clamp(split_fill // (x * per_block), 1, max_splits)`` shares, so that few tiles still
    give every program a unit. ``slots``: S, the CTAs (programs) that run at once.
    """

    name: str
    per_block: int
    slots: int
    split_fill: int = 0
    max_splits: int = 1

    def grid(self, blocks: int) -> int:
        tiles = blocks * self.per_block
        if tiles <= 0:
            return 0
        if self.split_fill:
            return tiles * min(max(self.split_fill // tiles, 1), self.max_splits)
        return tiles


@dataclass(frozen=True)
class GridPlan:
    """The launches of one call of ``config`` at a token count: its ``path`` (``direct`` /
    ``sorted`` for fused_moe, ``stored`` / ``aligned`` for the expert-major kernels), the
    token block ``bm`` whose blocks drive the grids, and the launches."""

    path: str
    bm: int
    launches: tuple[Launch, ...]

    def grids(self, blocks: int) -> list[tuple[int, int]]:
        """[(G, S)] of every launch for ``blocks`` token blocks."""
        return [(ln.grid(blocks), ln.slots) for ln in self.launches]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def decode_column_tile(H: int, hw: Hardware) -> int:
    """The decode schedule's GEMM2 column tile (as the kernels' launch planning picks it)."""
    return 64 if _cdiv(H, 32) > KERNEL_PLAN.decode_ctas_per_sm * hw.sms else 32


def token_path(config: KernelConfig, M: int) -> str:
    """``direct`` where every token fits one block (``fused_moe``'s alignment="auto"), else
    ``sorted``."""
    return "direct" if M <= config.bm else "sorted"


def grid_plan(shape: MoEShape, config: KernelConfig, M: int, hw: Hardware, *, elem_bytes: int = 2,
                family: str = "token", capacity: int | None = None) -> GridPlan:
    """What one call of ``config`` launches at ``M`` tokens (``family="token"``: fused_moe) or
    over an expert-major buffer of ``capacity`` rows per expert (``family="expert_major"``:
    fused_moe_expert_major; M is ignored)."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    H, N, E = shape.hidden, shape.intermediate, shape.num_experts
    c = config
    s1, a1 = _gemm1_footprint(c, elem_bytes)
    s2, a2 = _gemm2_footprint(c, elem_bytes)
    r1 = resident_per_sm(s1, a1, c.num_warps, hw)
    r2 = resident_per_sm(s2, a2, c.num_warps, hw)
    n1, n2 = _cdiv(N, c.bn), _cdiv(H, c.gemm2_bn)
    if family == "expert_major":
        if capacity is None or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1 for the expert_major family, got {capacity!r}")
        bound = E * _cdiv(capacity, c.bm)
        if c.form == "two_launch" and c.split_k == 1:
            cap = KERNEL_PLAN.expert_major_ctas_per_sm
            return GridPlan("stored", c.bm, (
                Launch("gemm1", n1, max(1, min(bound * n1, hw.sms * min(r1, cap)))),
                Launch("gemm2", n2, max(1, min(bound * n2, hw.sms * min(r2, cap))))))
        return GridPlan("aligned", c.bm, _aligned_launches(c, n1, n2, r1, r2, hw))
    if M < 1:
        raise ValueError(f"M must be an int >= 1, got {M!r}")
    path = token_path(c, M)
    if path == "direct" and c.form == "two_launch" and c.split_k == 1:
        # The decode schedule, one persistent cooperative launch: phase 1 walks (named
        # expert, N tile, reduction share) units, phase 2 the decode GEMM2's (column tile,
        # expert split) units, each split walking its share of the named experts -- modelled
        # as (named expert, column tile) work over the same programs.
        grid = hw.sms * min(r1, KERNEL_PLAN.persistent_ctas_per_sm)
        max_splits = max(1, min(_cdiv(H, c.bk), KERNEL_PLAN.persistent_max_splits))
        tiles2 = _cdiv(H, decode_column_tile(H, hw))
        return GridPlan("direct", c.bm, (
            Launch("persistent-1", n1, grid, split_fill=grid, max_splits=max_splits),
            Launch("persistent-2", tiles2, grid)))
    return GridPlan(path, c.bm, _aligned_launches(c, n1, n2, r1, r2, hw))


def _aligned_launches(c: KernelConfig, n1: int, n2: int, r1: int, r2: int, hw: Hardware) -> tuple[Launch, ...]:
    if c.form == "fused":
        return (Launch("fused", n1, hw.sms * r1),)
    return (Launch("gemm1", n1, hw.sms * r1), Launch("gemm2", n2 * c.split_k, hw.sms * r2))


def token_blocks(counts, bm: int, capacity: int | None = None) -> int:
    """``sum_e ceil(n_e / bm)`` of a histogram (sequence or 1-D tensor of per-expert counts;
    each clamped to ``capacity`` when given, as the expert-major kernels read it)."""
    total = 0
    for n in (counts.tolist() if isinstance(counts, torch.Tensor) else counts):
        n = int(n)
        if n < 0:
            raise ValueError(f"counts must be >= 0, got {n}")
        if capacity is not None:
            n = min(n, capacity)
        total += _cdiv(n, bm)
    return total


def grids(shape: MoEShape, config: KernelConfig, counts, hw: Hardware, *, M: int | None = None,
          elem_bytes: int = 2, family: str = "token", capacity: int | None = None) -> list[tuple[int, int]]:
    """[(G, S)] of every launch of ``config`` for the expert histogram ``counts`` (Eq. 1 per
    launch). ``M`` (token family): the tokens of the call, default ``max(counts)``'s lower
    bound ``ceil(sum(counts) / K)``."""
    if M is None:
        total = sum(int(n) for n in (counts.tolist() if isinstance(counts, torch.Tensor) else counts))
        M = max(1, _cdiv(total, shape.top_k))
    plan = grid_plan(shape, config, M, hw, elem_bytes=elem_bytes, family=family, capacity=capacity)
    return plan.grids(token_blocks(counts, config.bm, capacity if family == "expert_major" else None))


# -------------------------------------------------------------------- region variables


@dataclass(frozen=True)
class RegionVariables:
    """The paper's four variables for one (shape, config, histogram, GPU).

    rho: compute density, GEMM1's multiply-adds per CTA in 64 x 64 x 64 tile MMAs
    (``2 * bm * bn * H / 64**3``: gate and up). lam: L2 pressure, one expert's GEMM1 weights
    (``2 N H`` elements) over the effective L2. omega: wave utilization ``G / S`` of the call's
    first launch (Eq. 5). kappa: K-reduction depth, the ``bk`` chunks of the reduction that
    split-K divides (GEMM2's, over N, in this kernel). grid: [(G, S)] of every launch.
    """

    rho: float
    lam: float
    omega: float
    kappa: int
    grid: list = field(default_factory=list)


def l2_pressure(shape: MoEShape, hw: Hardware, elem_bytes: int = 2) -> float:
    """One expert's GEMM1 weight footprint over the effective L2 (Eq. 3/4: GROUP_M matters > 1)."""
    return 2 * shape.intermediate * shape.hidden * elem_bytes / hw.l2_effective


def region_variables(shape: MoEShape, config: KernelConfig, counts, hw: Hardware, *, M: int | None = None,
                     elem_bytes: int = 2) -> RegionVariables:
    g = grids(shape, config, counts, hw, M=M, elem_bytes=elem_bytes)
    G, S = g[0]
    return RegionVariables(rho=2 * config.bm * config.bn * shape.hidden / 64**3,
                           lam=l2_pressure(shape, hw, elem_bytes), omega=G / S,
                           kappa=_cdiv(shape.intermediate, config.bk), grid=g)


# ---------------------------------------------------------------------- predictions


@dataclass(frozen=True)
class PointPrediction:
    """Which modes the region analysis predicts to pay at one (M, histogram)."""

    group_m: bool
    split_k: bool
    small_bm: bool
    waste64: float  # padding fraction of 64-row blocks
    split_grid: int  # smallest GEMM2 grid (split_k = 1) of the space at this point


def predict_point(shape: MoEShape, counts, M: int, hw: Hardware, *, elem_bytes: int = 2,
                  space: list[KernelConfig] | None = None) -> PointPrediction:
    """The region analysis at one point.

    * GROUP_M: an expert's weights do not fit the effective L2 (``lam > 1``) and at least one
      expert has more than one token block at bm = 64 (only then do CTAs re-read an expert's
      weights; without swizzle that reuse is a whole expert's weights apart).
    * split-K: ``kappa >= KAPPA_MIN`` for the deepest reduction the space offers (bk = 64) and
      the smallest GEMM2 grid of the space (widest tile) stays within one wave of one CTA per
      SM after the split (``G * split_k <= SMs``: the paper's "fewer than 33 CTAs" for 4).
    * small bm (16 or 32): at least half of the rows of 64-row blocks would be padding.
    """
    counts = [int(n) for n in (counts.tolist() if isinstance(counts, torch.Tensor) else counts)]
    pairs = sum(counts)
    b64 = token_blocks(counts, 64)
    waste = 1.0 - pairs / (64 * b64) if b64 else 0.0
    many_blocks = any(n > 64 for n in counts)
    lam = l2_pressure(shape, hw, elem_bytes)
    if space is None:
        from moekit.kernels.configs import config_space

        space = config_space(shape, dtype=torch.float8_e4m3fn if elem_bytes == 1 else torch.bfloat16)
    kappa = _cdiv(shape.intermediate, 128 if elem_bytes == 1 else 64)  # the deepest chunking the space has
    # The smallest GEMM2 grid the space can launch here: the fewest token blocks (bm = 128)
    # times the fewest column tiles (the widest GEMM2 tile).
    b128 = token_blocks(counts, 128)
    widest = max((c.gemm2_bn for c in space if c.form == "two_launch"), default=64)
    split_grid = b128 * _cdiv(shape.hidden, widest)
    split = kappa >= KAPPA_MIN and 0 < split_grid * 4 <= hw.sms
    return PointPrediction(group_m=lam > 1 and many_blocks, split_k=split, small_bm=waste >= SMALL_BM_WASTE,
                           waste64=waste, split_grid=split_grid)


def predict_modes(shape: MoEShape, hw: Hardware, elem_bytes: int = 2, routed_experts: int | None = None) -> dict:
    """The shape's region and predicted modes, from geometry and hardware alone.

    Region A: an expert's GEMM1 weights fit the effective L2 (``lam <= 1``), B otherwise. The
    modes: GROUP_M where ``lam > 1``; split-K where ``kappa >= KAPPA_MIN`` and a decode grid
    (one token, its K experts, the widest GEMM2 tile) fits a quarter wave; small token blocks
    under skew wherever experts get fewer rows than a block at the batch sizes served -- for
    every shape with more experts than K (the skew leaves a tail of cold experts).
    ``routed_experts``: the experts the router picks from, when the shape is an EP shard.
    """
    from moekit.kernels.configs import config_space

    lam = l2_pressure(shape, hw, elem_bytes)
    space = config_space(shape, dtype=torch.float8_e4m3fn if elem_bytes == 1 else torch.bfloat16)
    kappa = _cdiv(shape.intermediate, 128 if elem_bytes == 1 else 64)
    widest = max((c.gemm2_bn for c in space if c.form == "two_launch"), default=64)
    # One token's experts on this shard (an EP shard holds E of routed_experts experts).
    local = max(1, round(shape.top_k * shape.num_experts / (routed_experts or shape.num_experts)))
    decode_grid = local * _cdiv(shape.hidden, widest)
    modes = ["tile"]
    if lam > 1:
        modes.append("GROUP_M")
    if kappa >= KAPPA_MIN and decode_grid * 4 <= hw.sms:
        modes.append("split-K")
    if shape.num_experts > shape.top_k:
        modes.append("small bm under skew")
    return {"region": "B" if lam > 1 else "A", "lam": lam, "kappa": kappa, "n_tiles": _cdiv(2 * shape.intermediate, 256),
            "decode_grid": decode_grid, "modes": modes,
            "rho_range": (2 * 16 * 64 * shape.hidden / 64**3, 2 * 128 * 256 * shape.hidden / 64**3)}


def wave_fill(G: int, S: int) -> float:
    """The fraction of the last wave's slots that hold a CTA (1 = full)."""
    if G <= 0:
        return 0.0
    waves = math.ceil(G / S)
    return (G - (waves - 1) * S) / S
