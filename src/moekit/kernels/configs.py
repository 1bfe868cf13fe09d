"""Tile configurations of the fused MoE kernel, and the space of valid ones for a model shape.

A :class:`KernelConfig` fixes everything that is compiled into the kernel (tile sizes, warps,
pipeline depth) and the two polymorphic modes RaMP dispatches at run time:
GROUP_M swizzle and split-K, plus the execution form (``two_launch`` or ``fused``).

:func:`config_space` enumerates the configurations that fit the hardware: their shared memory
fits one block's limit and their fp32 accumulators fit a register heuristic. Which of the valid
configurations is *fast* for a given routing is the selector's job (``moekit.ramp``), not this
module's; :func:`default_config` is only a reasonable static pick.

FP8 W8A8 (``dtype=torch.float8_e4m3fn``) has its own, smaller product (:func:`fp8_config_error`
gives the rules): the reduction chunk is one 128-wide scale block (bk = 128), output tiles are
whole 128-column quantization groups (bn in {128, 256}; the fused form re-quantizes its tile
in registers as one group, so bn = 128 there); since an fp8 tile takes half the shared
memory of a bf16 one, pipelines may be one stage deeper (up to 5), bm >= 64 tiles are
tried with 8 warps as well as 4, and bm < 64 tiles with their dots swapped (``swap_ab``) as
well as not.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch

from moekit.shapes import MoEShape

FORMS = ("two_launch", "fused")
TOKEN_BLOCKS = (16, 32, 64, 128)  # bm: the token rows one CTA takes from one expert

# Tile families (bn, bk). bn tiles the output columns of each GEMM (N for GEMM1, H for
# GEMM2); bk tiles the reduction (H for GEMM1, N for GEMM2). In the fused form bk also tiles
# the H columns of the down-projection that each CTA accumulates (see fused_moe.py).
TILE_FAMILIES = ((64, 64), (128, 64), (64, 128), (128, 128), (256, 64))
# Narrow, deep tiles for small token blocks (bm <= DECODE_MAX_BM), where the kernel streams
# weights: a narrow bn gives more CTAs for few active experts (deepseek-v3's TP8 shard, N = 256,
# has only 4 N-tiles of 64 per expert: 32 CTAs on 132 SMs at M = 1), and a deep bk keeps more
# bytes in flight per pipeline stage. Without swizzle (one token block per expert at decode).
DECODE_TILE_FAMILIES = ((16, 256), (32, 128), (32, 256))
DECODE_MAX_BM = 32
PIPELINE_STAGES = (2, 3, 4)
GROUP_M_CHOICES = (1, 8)  # 1 = no swizzle
SPLIT_K_CHOICES = (1, 4)  # split of GEMM2's reduction, two_launch form only
# GEMM2's own, wider output tile (bn2) in the two_launch form, for large token blocks (bf16):
# GEMM1 holds two [bm, bn] accumulators (gate and up), GEMM2 one, so GEMM2 can take a tile
# twice as wide for the same registers.
GEMM2_WIDE_BN = 256
GEMM2_WIDE_MIN_BM = 64

# FP8 W8A8: (bn, bk) families and pipeline depths (see fp8_config_error for why).
FP8_SCALE_BLOCK = 128
FP8_TILE_FAMILIES = ((128, 128), (256, 128))
FP8_PIPELINE_STAGES = (2, 3, 4, 5)

# Hopper (H100/H200): 228 KB shared memory per SM, of which one block may use 227 KB.
HOPPER_SMEM_PER_BLOCK = 227 * 1024
# Register heuristic: a thread has at most 255 registers; keep the fp32 accumulators of a CTA
# within about half of them, so address arithmetic, the pipelined operands and the epilogue
# fit without spilling to local memory.
MAX_ACC_REGS_PER_THREAD = 128


@dataclass(frozen=True)
class KernelConfig:
    """One compiled variant of the fused MoE kernel (frozen, hashable: usable as a dict key).

    bm: token block (rows of one expert per CTA). bn, bk: output and reduction tiles.
    num_warps, num_stages: Triton launch/pipelining parameters. group_m: GROUP_M swizzle
    (1 = off) of the (token block, column tile) grid so CTAs that share weight columns run
    close together in time (L2 reuse). split_k: number of CTAs that share GEMM2's reduction
    over N, accumulating with atomics (two_launch only; the fused form is already split over
    N by construction). form: ``"two_launch"`` or ``"fused"``. bn2: GEMM2's output tile
    (over H) in the two_launch form, 0 = bn; GEMM2 has one accumulator where GEMM1 has two
    (gate and up), so at large token blocks it can take a tile twice as wide. swap_ab (FP8
    only, bm < 64): the FP8 dots run as (w.T @ x.T).T, so Hopper's FP8 warpgroup MMA, which
    takes its left operand in 64-row blocks, gets the weight tile there instead of the few
    tokens (``fused_moe._fp8_dot``); faster or slower depending on the routing, so a mode
    of the space rather than a rule.
    """

    bm: int = 64
    bn: int = 128
    bk: int = 64
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 1
    split_k: int = 1
    form: str = "two_launch"
    bn2: int = 0
    swap_ab: bool = False

    def __post_init__(self) -> None:
        if self.bm not in TOKEN_BLOCKS:
            raise ValueError(f"KernelConfig.bm must be one of {TOKEN_BLOCKS}, got {self.bm!r}")
        for name in ("bn", "bk"):
            v = getattr(self, name)
            # tl.dot needs every dimension >= 16 and tl.arange needs powers of two.
            if not isinstance(v, int) or v < 16 or v & (v - 1):
                raise ValueError(f"KernelConfig.{name} must be a power of two >= 16, got {v!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"KernelConfig.num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps!r}")
        if not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= 8:
            raise ValueError(f"KernelConfig.num_stages must be in [1, 8], got {self.num_stages!r}")
        if not isinstance(self.group_m, int) or self.group_m < 1:
            raise ValueError(f"KernelConfig.group_m must be an int >= 1 (1 = no swizzle), got {self.group_m!r}")
        if not isinstance(self.split_k, int) or self.split_k < 1:
            raise ValueError(f"KernelConfig.split_k must be an int >= 1, got {self.split_k!r}")
        if self.form not in FORMS:
            raise ValueError(f"KernelConfig.form must be one of {FORMS}, got {self.form!r}")
        if self.form == "fused" and self.split_k != 1:
            raise ValueError("KernelConfig.split_k must be 1 in the fused form (it is split over N already)")
        if self.bn2 and (self.bn2 < 16 or self.bn2 & (self.bn2 - 1)):
            raise ValueError(f"KernelConfig.bn2 must be 0 (= bn) or a power of two >= 16, got {self.bn2!r}")
        if self.bn2 and self.form == "fused":
            raise ValueError("KernelConfig.bn2 must be 0 in the fused form (it has no separate GEMM2)")
        if not isinstance(self.swap_ab, bool):
            raise ValueError(f"KernelConfig.swap_ab must be a bool, got {self.swap_ab!r}")
        if self.swap_ab and self.bm >= 64:
            raise ValueError("KernelConfig.swap_ab needs bm < 64 (the warpgroup MMA takes 64-row token blocks "
                             f"as they are), got bm={self.bm}")

    @property
    def id(self) -> str:
        """The config's short name, unique within any space, e.g. ``T-bm16-bn64-bk128-w4-s4-g1-k4``:
        T two_launch or F fused, ``-n256`` when GEMM2 has its own tile (bn2), ``-x`` when FP8's
        dots are swapped (swap_ab). Kernel datasets key their configs by it."""
        form = "F" if self.form == "fused" else "T"
        wide = f"-n{self.bn2}" if self.bn2 else ""
        swap = "-x" if self.swap_ab else ""
        return (f"{form}-bm{self.bm}-bn{self.bn}-bk{self.bk}-w{self.num_warps}-s{self.num_stages}"
                f"-g{self.group_m}-k{self.split_k}{wide}{swap}")

    @classmethod
    def from_id(cls, name: str) -> "KernelConfig":
        """The config whose :attr:`id` is ``name`` (ValueError for anything else)."""
        if not isinstance(name, str):
            raise ValueError(f"a KernelConfig id must be a str, got {type(name).__name__}")
        parts = name.split("-")
        try:
            form = {"T": "two_launch", "F": "fused"}[parts[0]]
            fields = dict(bm=parts[1], bn=parts[2], bk=parts[3], num_warps=parts[4], num_stages=parts[5],
                          group_m=parts[6], split_k=parts[7])
            prefixes = dict(bm="bm", bn="bn", bk="bk", num_warps="w", num_stages="s", group_m="g", split_k="k")
            values = {}
            for key, text in fields.items():
                if not text.startswith(prefixes[key]):
                    raise KeyError(key)
                values[key] = int(text[len(prefixes[key]):])
            rest = parts[8:]
            bn2 = int(rest.pop(0)[1:]) if rest and rest[0].startswith("n") else 0
            swap = bool(rest) and rest.pop(0) == "x"
            if rest:
                raise KeyError(rest[0])
        except (KeyError, IndexError, ValueError):
            raise ValueError(f"not a KernelConfig id: {name!r} (e.g. 'T-bm16-bn64-bk128-w4-s4-g1-k1')") from None
        config = cls(form=form, bn2=bn2, swap_ab=swap, **values)
        if config.id != name:
            raise ValueError(f"not a KernelConfig id: {name!r} (it reads as {config.id!r})")
        return config

    @property
    def gemm2_bn(self) -> int:
        """GEMM2's output tile over H in the two_launch form."""
        return self.bn2 or self.bn

    def smem_bytes(self, elem_bytes: int = 2) -> int:
        """Estimated shared memory of the largest kernel of this config (bytes).

        Triton keeps ``num_stages`` copies of every operand tile that a pipelined loop feeds
        to ``tl.dot``. GEMM1 streams an activation tile [bm, bk] and two weight tiles (gate
        and up) [bn, bk]; GEMM2 streams [bm, bk] and [bn, bk]. The fused form adds the
        down-projection's weight tile [bk, bn] and its SwiGLU output [bm, bn] staged for the
        second dot.
        """
        gemm1 = self.num_stages * (self.bm * self.bk + 2 * self.bn * self.bk) * elem_bytes
        if self.form == "fused":
            return gemm1 + (self.bk * self.bn + self.bm * self.bn) * elem_bytes * 2
        gemm2 = self.num_stages * (self.bm * self.bk + self.gemm2_bn * self.bk) * elem_bytes
        return max(gemm1, gemm2)

    def acc_regs_per_thread(self) -> int:
        """fp32 accumulator registers per thread of the larger kernel: GEMM1's gate + up [bm, bn]
        each, plus in the fused form the down-projection partial [bm, bk]; GEMM2's [bm, bn2]."""
        acc = 2 * self.bm * self.bn + (self.bm * self.bk if self.form == "fused" else 0)
        if self.form == "two_launch":
            acc = max(acc, self.bm * self.gemm2_bn)
        return acc // (32 * self.num_warps)

    def fits(self, smem_limit: int = HOPPER_SMEM_PER_BLOCK, elem_bytes: int = 2) -> bool:
        return (self.smem_bytes(elem_bytes) <= smem_limit
                and self.acc_regs_per_thread() <= MAX_ACC_REGS_PER_THREAD)


def fp8_config_error(config: KernelConfig) -> str | None:
    """Why ``config`` cannot run the FP8 W8A8 kernels, or None when it can.

    bk = 128: each reduction chunk must be exactly one scale block, so one activation scale
    per row and one weight scale per column apply to the whole chunk's dot product. bn a
    multiple of 128: the SwiGLU output tile is re-quantized in whole 128-column groups (and a
    bn = 256 tile takes per-column weight scales, so it may span two weight blocks). fused:
    bn = 128, because the in-register tile is one group whose single per-row scale feeds the
    down-projection's reduction over that tile.
    """
    b = FP8_SCALE_BLOCK
    if config.bk != b:
        return f"KernelConfig.bk must be {b} for FP8 (one scale block per reduction chunk), got {config.bk}"
    if config.bn % b:
        return f"KernelConfig.bn must be a multiple of {b} for FP8 (whole quantization groups), got {config.bn}"
    if config.form == "fused" and config.bn != b:
        return f"KernelConfig.bn must be {b} for FP8 in the fused form (one group per tile), got {config.bn}"
    return None


def _warps_for(bm: int, bn: int) -> int:
    # One warpgroup (4 warps) for small tiles; two for the large ones so the accumulator
    # per thread stays within the register budget.
    return 8 if bm * bn >= 64 * 256 else 4


def _fp8_warps_for(bm: int, bn: int) -> tuple[int, ...]:
    # FP8 also tries two warpgroups for bm >= 64 tiles that one warpgroup could take: it halves
    # the accumulator registers per thread, which admits the fused form at bm = 64.
    w = _warps_for(bm, bn)
    return (w, 8) if w == 4 and bm >= 64 else (w,)


def _smem_limit(device) -> int:
    """The per-block shared-memory limit of ``device`` (Hopper's when it cannot be read)."""
    if device is not None:
        dev = torch.device(device)
        if dev.type == "cuda" and torch.cuda.is_available():
            props = torch.cuda.get_device_properties(dev)
            limit = getattr(props, "shared_memory_per_block_optin", 0)
            if limit:
                return int(limit)
    return HOPPER_SMEM_PER_BLOCK


def config_space(shape: MoEShape, device=None, *, dtype: torch.dtype = torch.bfloat16) -> list[KernelConfig]:
    """All valid configurations for ``shape`` on ``device`` (None or CPU: assume H100/H200).

    The product of token blocks x tile families x pipeline depths x GROUP_M x (two_launch with
    each split-K | fused), keeping those whose shared memory fits one block and whose
    accumulators pass the register heuristic. Tiles wider than the (power-of-two-rounded)
    dimension they tile are dropped, since they only add masked work. The order is
    deterministic.

    ``dtype=torch.float8_e4m3fn``: the FP8 W8A8 space (FP8 tile families and depths, only
    configs with ``fp8_config_error(c) is None``, shared memory at 1 byte per element, and
    every bm < 64 config also with ``swap_ab``).
    """
    fp8 = dtype == torch.float8_e4m3fn
    elem = torch.empty((), dtype=dtype).element_size()
    limit = _smem_limit(device)
    H, N = shape.hidden, shape.intermediate
    cap_n = max(64, _next_pow2(min(H, N)))  # bn tiles N (GEMM1) and H (GEMM2)
    cap_k = max(64, _next_pow2(min(H, N)))  # bk tiles H (GEMM1) and N (GEMM2)
    families = FP8_TILE_FAMILIES if fp8 else TILE_FAMILIES
    depths = FP8_PIPELINE_STAGES if fp8 else PIPELINE_STAGES
    tiles = itertools.product(TOKEN_BLOCKS, families, depths, GROUP_M_CHOICES)
    if not fp8:  # (FP8 tiles are whole 128-column groups: no narrow family)
        decode = itertools.product([b for b in TOKEN_BLOCKS if b <= DECODE_MAX_BM], DECODE_TILE_FAMILIES, depths, (1,))
        tiles = itertools.chain(tiles, decode)
    out = []
    # (FP8 needs H and N to be multiples of 128, so its (128, 128) family always passes this.)
    for bm, (bn, bk), stages, group_m in tiles:
        if bn > cap_n or bk > cap_k:
            continue
        variants = [("two_launch", s) for s in SPLIT_K_CHOICES] + [("fused", 1)]
        warps = _fp8_warps_for(bm, bn) if fp8 else (_warps_for(bm, bn),)
        for (form, split_k), num_warps in itertools.product(variants, warps):
            cfg = KernelConfig(bm=bm, bn=bn, bk=bk, num_warps=num_warps, num_stages=stages,
                               group_m=group_m, split_k=split_k, form=form)
            if fp8 and fp8_config_error(cfg):
                continue
            if cfg.fits(limit, elem):
                out.append(cfg)
                if fp8 and bm < 64:
                    out.append(replace(cfg, swap_ab=True))
                if (not fp8 and form == "two_launch" and split_k == 1 and bm >= GEMM2_WIDE_MIN_BM
                        and bn < GEMM2_WIDE_BN <= cap_n):
                    wide = replace(cfg, bn2=GEMM2_WIDE_BN)
                    if wide.fits(limit, elem):
                        out.append(wide)
    return out


def default_config(M: int, shape: MoEShape, *, dtype: torch.dtype = torch.bfloat16) -> KernelConfig:
    """A static pick from the batch size alone (what production systems do; RaMP does better).

    Expected rows per active expert ~ M*K/E: use the smallest token block that is not mostly
    padding, wide tiles for large batches, and split GEMM2's reduction at tiny batches where
    the grid is far below one wave. ``dtype=torch.float8_e4m3fn`` picks from the FP8 rules
    (bn = bk = 128), with the dots swapped at decode, where the swapped default was the faster
    at most decode points measured (docs/kernel.md).
    """
    fp8 = dtype == torch.float8_e4m3fn
    rows = max(1, M * shape.top_k // shape.num_experts)
    bm = next((b for b in TOKEN_BLOCKS if b >= rows), TOKEN_BLOCKS[-1])
    if M * shape.top_k <= 64:  # decode: a sub-wave grid, weights dominate
        bn = 128 if fp8 else 64
        return KernelConfig(bm=16, bn=bn, bk=128, num_warps=4, num_stages=4, split_k=4, form="two_launch",
                            swap_ab=fp8)
    bn = 128 if bm >= 64 or fp8 else 64
    bk = 128 if fp8 else 64
    return KernelConfig(bm=bm, bn=bn, bk=bk, num_warps=_warps_for(bm, bn), num_stages=3, group_m=8,
                        form="two_launch")


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
