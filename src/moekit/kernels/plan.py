"""How a fused-MoE call is launched, as one explicit object: :class:`LaunchPlan`.

A :class:`~moekit.kernels.configs.KernelConfig` fixes what is compiled (tiles, warps, stages,
form); a :class:`LaunchPlan` fixes how a call runs around it: whether the decode schedule is one
persistent kernel or two, how many CTAs per SM its grids take, how a split tile is summed, how
wide the decode GEMM2's chunks grow, whether kernels launch with programmatic dependent launch
(``pdl``), and the probes' timestamp buffer. Every choice is a field with the library's default,
so a caller (a probe, a test, a routing-aware selector) states what it wants and passes it:
``fused_moe(..., plan=LaunchPlan(decode_persistent=False))``. Every plan gives a deterministic
decode schedule; the fields that shape its grid or its reductions (``decode_persistent``,
``persistent_ctas_per_sm``, ``persistent_max_splits``, ``decode_ctas_per_sm``, the chunk sizes,
``interpret_grid``) may change the float32 summation order, and so the last bits; the fix-up
plans, the expert-major grid caps, PDL and the stamps do not change a bit.

The functions below derive the decode schedule's launch shape from a plan, the shape and the
device's SM count (host side, no kernel).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from moekit.kernels.occupancy import sm_count

# Kernel roles in a call's chain under PDL (``moekit.kernels.pdl``), and those whose dependents
# may launch at their start by default. The GEMM1s never do: a GEMM2 follows them, no short kernel.
PDL_ROLES = ("zero", "quant", "gemm1", "gemm2", "fused")
PDL_EARLY_ROLES = frozenset({"zero", "quant", "gemm2", "fused"})


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@dataclass(frozen=True)
class FixupPlan:
    """How the persistent decode kernel sums a phase-1 tile whose reduction is split into shares.

    ``shared``: every share waits until all have stored their partials, then sums and stores its
    own row blocks (share, share + splits, ...); False: the share that arrives last sums every
    block. ``row_blocks`` (a power of two): the tile's rows are summed and stored in that many
    blocks (at most the tile's rows). Every element is the same sum either way, bit for bit.
    """

    shared: bool
    row_blocks: int

    def __post_init__(self):
        if not isinstance(self.shared, bool):
            raise ValueError(f"FixupPlan.shared must be a bool, got {self.shared!r}")
        if not isinstance(self.row_blocks, int) or not _power_of_two(self.row_blocks):
            raise ValueError(f"FixupPlan.row_blocks must be a power of two >= 1, got {self.row_blocks!r}")


@dataclass(frozen=True)
class LaunchPlan:
    """The launch choices of a fused-MoE call (frozen, hashable); the defaults are the library's.

    Decode schedule (two_launch, split_k = 1, direct addressing):

    * ``decode_persistent``: one cooperative launch (GEMM1, a grid barrier, GEMM2:
      ``decode_kernels.persistent_decode_kernel``) instead of two kernels (kept to compare them).
    * ``persistent_ctas_per_sm``: the most CTAs per SM of that grid (fewer where the compiled
      kernel's registers or shared memory do not allow it).
    * ``persistent_max_splits``: the most shares one GEMM1 tile's reduction is split into.
    * ``fixup_fp8`` / ``fixup_16bit``: how split phase-1 tiles are summed (:class:`FixupPlan`).
      FP8 tiles share the sum: the last share's re-quantizing epilogue was the end of phase 1.
      16-bit tiles are summed whole by the last share: the shared sum was slower there.
    * ``decode_ctas_per_sm``: the decode GEMM2 splits the named experts over more CTAs per column
      tile until its grid has about this many per SM (0: never split).
    * ``decode_w2_chunk_bytes``: the decode GEMM2's reduction chunk is widened (powers of two,
      from the config's bk) towards this many bytes of w2 per [chunk, column tile]: each CTA
      streams w2 with one or two CTAs per SM, so it must keep many bytes in flight (Little's
      law: about 32 GB/s per SM times 1-2 µs of loaded latency). 0: the config's bk.
    * ``decode_w2_chunk_bytes_fp8``: the same for FP8 w2 under token blocks of at most 32 rows,
      where the compiled kernels hold stages - 1 chunk copies (not ``stages``), so a wider chunk
      still fits two CTAs per SM. 0: the config's bk.
    * ``decode_smem_budget``: the shared memory the chunk's pipeline copies may take per SM,
      divided among the CTAs an SM then holds.
    * ``interpret_grid``: the persistent kernel's programs in Triton's interpreter, which runs
      them one after another (a few exercise the loops; more than the tiles split reductions).

    Expert-major layout (``fused_moe_expert_major``, two_launch, split_k = 1):
    ``expert_major_ctas_per_sm`` (the persistent grids' cap per SM) and
    ``expert_major_interpret_grid`` (their programs in the interpreter).

    Programmatic dependent launch (``moekit.kernels.pdl``): ``pdl`` None follows the environment
    (``MOEKIT_PDL``, read at import; on by default), True / False turn it on or off (it is used
    only where the device has it: sm_90 and newer, not the interpreter). ``pdl_early``: the
    kernel roles (``PDL_ROLES``) whose dependents may launch at their start.

    ``stamps`` (probes only): an int64 CUDA tensor of at least 8 x grid elements; every
    persistent decode launch then writes its programs' phase timestamps there. Not part of
    equality or the hash.
    """

    decode_persistent: bool = True
    persistent_ctas_per_sm: int = 2
    persistent_max_splits: int = 8
    fixup_fp8: FixupPlan = FixupPlan(shared=True, row_blocks=4)
    fixup_16bit: FixupPlan = FixupPlan(shared=False, row_blocks=1)
    decode_ctas_per_sm: int = 2
    decode_w2_chunk_bytes: int = 16 * 1024
    decode_w2_chunk_bytes_fp8: int = 32 * 1024
    decode_smem_budget: int = 192 * 1024
    interpret_grid: int = 5
    expert_major_ctas_per_sm: int = 4
    expert_major_interpret_grid: int = 3
    pdl: bool | None = None
    pdl_early: frozenset = PDL_EARLY_ROLES
    stamps: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        for name in ("decode_persistent",):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LaunchPlan.{name} must be a bool, got {getattr(self, name)!r}")
        minimum = dict(persistent_ctas_per_sm=1, persistent_max_splits=1, decode_ctas_per_sm=0,
                       decode_w2_chunk_bytes=0, decode_w2_chunk_bytes_fp8=0, decode_smem_budget=1, interpret_grid=1,
                       expert_major_ctas_per_sm=1, expert_major_interpret_grid=1)
        for name, low in minimum.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"LaunchPlan.{name} must be an int >= {low}, got {value!r}")
        for name in ("fixup_fp8", "fixup_16bit"):
            if not isinstance(getattr(self, name), FixupPlan):
                raise ValueError(f"LaunchPlan.{name} must be a FixupPlan, got {getattr(self, name)!r}")
        if self.pdl is not None and not isinstance(self.pdl, bool):
            raise ValueError(f"LaunchPlan.pdl must be None, True or False, got {self.pdl!r}")
        early = self.pdl_early
        if isinstance(early, str) or not all(isinstance(r, str) for r in early) or not set(early) <= set(PDL_ROLES):
            raise ValueError(f"LaunchPlan.pdl_early must be a set of roles from {PDL_ROLES}, got {early!r}")
        object.__setattr__(self, "pdl_early", frozenset(early))
        s = self.stamps
        if s is not None and (not isinstance(s, torch.Tensor) or s.dtype != torch.int64):
            raise ValueError("LaunchPlan.stamps must be None or an int64 tensor (8 timestamps per program)")

    def replace(self, **changes) -> LaunchPlan:
        """This plan with ``changes`` (field names as keywords)."""
        return dataclasses.replace(self, **changes)


DEFAULT_PLAN = LaunchPlan()


def check_plan(plan) -> LaunchPlan:
    """``plan``, or the default for None; anything else is a ValueError."""
    if plan is None:
        return DEFAULT_PLAN
    if not isinstance(plan, LaunchPlan):
        raise ValueError(f"plan must be a moekit.kernels.LaunchPlan or None, got {type(plan).__name__}")
    return plan


def decode_column_tile(H: int, device: torch.device, plan: LaunchPlan = DEFAULT_PLAN) -> int:
    """The decode schedule's GEMM2 column tile (not the config's bn, which tiles GEMM1 there).

    32 columns: with each [chunk, tile] of w2 a CTA also reads the [bm, chunk] slice of the
    intermediate (from L2), so a 16-column tile reads as many intermediate bytes as weight
    bytes. The GPU is filled by splitting the experts (:func:`decode_gemm2_plan`) rather than by
    narrowing the tile; 64 columns only where 32 would give more than ``decode_ctas_per_sm``
    CTAs per SM on its own (H > 8448 on 132 SMs).
    """
    return 64 if -(-H // 32) > plan.decode_ctas_per_sm * sm_count(device) else 32


def decode_gemm2_plan(H: int, N: int, bm: int, bk: int, stages: int, elem_bytes: int, max_blocks: int,
                      device: torch.device, plan: LaunchPlan = DEFAULT_PLAN) -> tuple[int, int, int]:
    """(column tile, reduction chunk, expert splits) of the decode schedule's GEMM2.

    The column tile is :func:`decode_column_tile`'s. The splits bring the grid (column tiles x
    splits) to about ``decode_ctas_per_sm`` CTAs per SM, at most one split per block that can be
    named (``max_blocks``). The chunk is the config's bk, widened (in powers of two) towards
    ``decode_w2_chunk_bytes`` of w2 and N rounded up to a power of two, as long as ``stages``
    copies of the [bm, chunk] and [chunk, tile] tiles fit ``decode_smem_budget`` shared among the
    CTAs an SM then holds; the pipeline depth stays the config's. FP8 (bk = 128) widens it by
    whole scale groups, one dot per group; with bm <= 32 towards ``decode_w2_chunk_bytes_fp8``,
    counting stages - 1 copies (compiled for sm_90 at bm 16 / 32, those kernels' shared memory
    is phase 1's tiles plus stages - 1 chunk copies; at bm >= 64 they hold ``stages`` copies and
    more, so they keep the 16-bit rule).
    """
    bn = decode_column_tile(H, device, plan)
    tiles = -(-H // bn)
    sms = sm_count(device)
    splits = max(1, min(max_blocks, round(plan.decode_ctas_per_sm * sms / tiles)))
    narrow_fp8 = elem_bytes == 1 and bm <= 32
    chunk_bytes, copies = ((plan.decode_w2_chunk_bytes_fp8, stages - 1) if narrow_fp8
                           else (plan.decode_w2_chunk_bytes, stages))
    budget = plan.decode_smem_budget // max(1, min(plan.decode_ctas_per_sm, -(-tiles * splits // sms)))
    target = min(max(bk, chunk_bytes // (bn * elem_bytes)), 1 << max(0, N - 1).bit_length())
    chunk = bk
    while chunk < target and copies * (bm + bn) * 2 * chunk * elem_bytes <= budget:  # (the doubled chunk)
        chunk *= 2
    return bn, chunk, splits


def fixup_plan(fp8: bool, bm: int, interp: bool, plan: LaunchPlan = DEFAULT_PLAN) -> tuple[bool, int]:
    """(every share sums its row blocks, row blocks) for a split phase-1 tile of the persistent
    decode kernel (:class:`FixupPlan`). The interpreter runs programs one after another, so a
    share there cannot wait for the others: the last one sums every block."""
    fix = plan.fixup_fp8 if fp8 else plan.fixup_16bit
    return fix.shared and not interp, min(fix.row_blocks, bm)
