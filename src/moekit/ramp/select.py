"""Choosing the fused kernel's configuration from the live expert histogram.

At run time the cost model is evaluated on the device: the histogram of ``topk_ids`` (or a
dispatcher's ``counts``), every variant's CTA grids and cost, and the argmin, in one Triton
kernel (:func:`choose_device`; a torch version of the same arithmetic runs where Triton does
not). The host reads one int: the winning variant. :class:`Selector` caches that answer per
forward step, keyed by the token count, so every MoE layer of a step after the first reuses it
without a host read (the RaMP paper's per-step amortization).

Step boundaries: ``select(..., layer=key)`` starts a new step when a layer key comes back (the
model ran through its layers once); ``with selector.step():`` (or :func:`step` for every
selector) marks one explicitly; outside both, every call selects afresh (one host read each).

No model file for the shape and GPU: the selector falls back to the region analysis
(:mod:`moekit.ramp.fallback`), with a one-time warning that says how to profile the shape.

How the configuration policy (:mod:`moekit.ops.policy`, the one module above the kernels)
calls this (``config="auto"``): :func:`auto_config` for token-major calls and
:func:`auto_config_expert_major` for expert-major ones, both through :meth:`Selector.auto`,
which adds two rules to :meth:`Selector.select`:

* Inside a CUDA-graph capture (the low-latency layer, a captured ``MoELayer``) no value may be
  read back, and a graph replays whatever it captured: the call runs the *static choice* for
  its token count (:meth:`Selector.static_choice`: with a fitted model the least mean predicted
  time over a sweep of routings, the graph path's ``static`` mode; without one the kernel's own
  default). A graph that chooses per replay is :class:`moekit.ramp.graphs.GraphedMoE`.
* The first call at a token count runs that static choice too, without reading the routing:
  Triton loads a kernel's module at its first launch, which is not allowed during a capture,
  so the warm-up call every graph needs before its capture loads exactly what the graph runs.

``reads="when_pays"`` (the ``"ramp"`` policy: :func:`ramp_config`, :func:`ramp_config_expert_major`) reads the
routing only at token counts where the model predicts that reading pays for itself
(:meth:`Selector.read_pays`: the predicted gain of the live choice over the static one on the
routing it read, plus its gain on the other calls it serves, whose routings share the skew but
not the experts, against the read's measured cost, :data:`GRAPHED_READ_COST_US`); elsewhere it
runs the static choice.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from moekit.kernels.configs import KernelConfig
from moekit.ramp.costmodel import PHIS, CostModel, empty_call_rank
from moekit.ramp.fallback import fallback_choice, templates
from moekit.ramp.modelfile import dtype_name, find_model, load_model, model_filename
from moekit.ramp.regions import Hardware, hardware_for, grid_plan
from moekit.shapes import MoEShape

try:  # Triton is optional: without it the torch version of the selection runs.
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = tl = None
    HAVE_TRITON = False

BMS = (16, 32, 64, 128)
MAX_LAUNCHES = 2
# What one live selection costs a forward step, host read included (medians over the shipped
# H100 models, docs/ramp.md "Selection at run time"): through the captured selection (the
# default on CUDA) and through the eager Triton launch. Selector.read_pays weighs the model's
# predicted gain against the one in use.
GRAPHED_READ_COST_US = 41.0
EAGER_READ_COST_US = 120.0
GRAPHED_READS = 64  # captured selections a selector keeps (one per token count or capacity)
_FP8 = torch.float8_e4m3fn


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ---------------------------------------------------------------------- device tables


@dataclass
class DeviceModel:
    """The variants of a :class:`CostModel` as flat tensors on one device (row = variant).

    ``config`` [V] the config index, ``bm_index`` [V] the position of its bm in (16, 32, 64,
    128), ``direct`` [V] 1 / 0 for the token path's direct / sorted variants (-1: always
    valid, the expert-major family), ``bm`` [V]; per launch (up to two): ``per_block``,
    ``slots``, ``split_fill``, ``max_splits`` [V, 2] (see :class:`moekit.ramp.regions.Launch`;
    a missing launch has per_block 0); ``coef`` [V, 6] float32; ``empty_rank`` [V] float32
    (:func:`moekit.ramp.costmodel.empty_call_rank`, the order for a histogram with no pair).
    """

    config: torch.Tensor
    bm_index: torch.Tensor
    direct: torch.Tensor
    bm: torch.Tensor
    per_block: torch.Tensor
    slots: torch.Tensor
    split_fill: torch.Tensor
    max_splits: torch.Tensor
    coef: torch.Tensor
    empty_rank: torch.Tensor
    wave_ceil: bool
    ratio_waves: bool  # the 2-term form's wave feature: sum of G / S
    phi: int  # index into PHIS
    capacity: int  # 0: no clamp (token family)
    rows: list[int]  # config index of every row, on the host

    @property
    def num_variants(self) -> int:
        return self.config.shape[0]


def device_model(model: CostModel, device: torch.device | str, capacity: int | None = None,
                 configs: list[int] | None = None) -> DeviceModel:
    """Flatten ``model`` for ``device``; ``configs``: only the variants of these config indices."""
    device = torch.device(device)
    keep = None if configs is None else set(configs)
    rows = sorted(k for k in model.variants if keep is None or k[0] in keep)
    if not rows:
        raise ValueError("no fitted variant among the configs asked for")
    cap = capacity if model.family == "expert_major" else None
    if model.family == "expert_major" and cap is None:
        cap = model.capacity
    V = len(rows)
    ints = {k: np.zeros((V, MAX_LAUNCHES), dtype=np.int64) for k in ("per_block", "slots", "split_fill", "max_splits")}
    ints["slots"][:] = 1
    ints["max_splits"][:] = 1
    cfg, bm_index, direct, bm = (np.zeros(V, dtype=np.int64) for _ in range(4))
    coef = np.zeros((V, 6), dtype=np.float64)
    empty_rank = np.zeros(V, dtype=np.float64)
    for r, (i, path) in enumerate(rows):
        c = model.configs[i]
        if model.family == "token":
            M = 1 if path == "direct" else c.bm + 1
            direct[r] = 1 if path == "direct" else 0
        else:
            M = 1
            direct[r] = -1
        plan = grid_plan(model.shape, c, M, model.hardware, elem_bytes=model.elem_bytes, family=model.family,
                           capacity=cap)
        if plan.path != path:
            raise ValueError(f"variant ({i}, {path}) has no such path for this family: {plan.path}")
        if len(plan.launches) > MAX_LAUNCHES:
            raise ValueError(f"config {i} has {len(plan.launches)} launches; the selector takes {MAX_LAUNCHES}")
        for k, ln in enumerate(plan.launches):
            ints["per_block"][r, k] = ln.per_block
            ints["slots"][r, k] = ln.slots
            ints["split_fill"][r, k] = ln.split_fill
            ints["max_splits"][r, k] = ln.max_splits
        cfg[r], bm_index[r], bm[r] = i, BMS.index(c.bm), c.bm
        empty_rank[r] = empty_call_rank(c, plan)
        v = model.variants[(i, path)]
        coef[r] = v.coef
        # The terms features() leaves at 0 for this variant's form contribute nothing here either.
        if model.form.terms == 2:
            coef[r, 2] = 0.0
        if model.form.terms < 4 or not v.subwave:
            coef[r, 3] = 0.0
        if not model.form.traffic:
            coef[r, 4:] = 0.0
    i32 = dict(dtype=torch.int32, device=device)
    return DeviceModel(
        torch.as_tensor(cfg, **i32), torch.as_tensor(bm_index, **i32), torch.as_tensor(direct, **i32),
        torch.as_tensor(bm, **i32), *(torch.as_tensor(ints[k], **i32).contiguous()
                                       for k in ("per_block", "slots", "split_fill", "max_splits")),
        torch.as_tensor(coef, dtype=torch.float32, device=device).contiguous(),
        torch.as_tensor(empty_rank, dtype=torch.float32, device=device),
        wave_ceil=model.form.wave == "ceil" and model.form.terms > 2, ratio_waves=model.form.terms == 2,
        phi=PHIS.index(model.form.phi), capacity=cap or 0, rows=[int(i) for i in cfg])


# ---------------------------------------------------------------- evaluation (torch)


def histogram(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int32 pairs per expert of ``topk_ids`` (-1 and out-of-range slots ignored); no sync."""
    ids = topk_ids.reshape(-1).to(torch.int64)
    valid = (ids >= 0) & (ids < num_experts)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, torch.where(valid, ids, 0), valid.to(torch.int64))
    return counts.to(torch.int32)


def costs_torch(dm: DeviceModel, counts: torch.Tensor, M: int) -> torch.Tensor:
    """[V] float32 predicted µs of every variant for the histogram ``counts`` at ``M`` tokens
    (inf where the variant's path is not the one fused_moe takes at M). The arithmetic of the
    Triton kernel, in torch ops (no host sync)."""
    n = counts.to(torch.int64).clamp(min=0)
    if dm.capacity:
        n = n.clamp(max=dm.capacity)
    bms = torch.tensor(BMS, dtype=torch.int64, device=n.device)
    blocks4 = ((n[None, :] + bms[:, None] - 1) // bms[:, None]).sum(1)
    active = (n > 0).sum().to(torch.float32)
    pairs = n.sum().to(torch.float32)
    x = blocks4[dm.bm_index.long()]
    tiles = x[:, None] * dm.per_block.long()
    split = torch.where(dm.split_fill > 0,
                        torch.minimum(torch.maximum(dm.split_fill.long() // tiles.clamp(min=1), torch.ones_like(tiles)),
                                      dm.max_splits.long()), torch.ones_like(tiles))
    G = tiles * split
    S = dm.slots.long()
    u = G.to(torch.float32) / S.to(torch.float32)
    if dm.ratio_waves or not dm.wave_ceil:
        waves = u
    else:
        waves = ((G + S - 1) // S).to(torch.float32)
    uc = u.clamp(0.0, 1.0)
    ph = torch.sqrt(uc) if dm.phi == 0 else torch.log2(1.0 + uc) if dm.phi == 1 else uc * (2.0 - uc)
    c = dm.coef
    cost = (c[:, 0] + c[:, 1] * waves.sum(1) + c[:, 2] * G.to(torch.float32).sum(1) + c[:, 3] * ph.sum(1)
            + c[:, 4] * active + c[:, 5] * pairs)
    valid = (dm.direct < 0) | ((dm.direct == 1) == (M <= dm.bm))
    return torch.where(valid, cost, torch.full_like(cost, float("inf")))


def selection_keys(dm: DeviceModel, counts: torch.Tensor, cost: torch.Tensor) -> torch.Tensor:
    """[V] what the argmin runs over: ``cost`` (:func:`costs_torch`), or for a histogram with no
    pair the empty-call rank where the cost is finite (no host sync)."""
    empty = (counts.to(torch.int64).clamp(min=0).sum() == 0)
    ranked = torch.where(torch.isfinite(cost), dm.empty_rank, torch.full_like(cost, float("inf")))
    return torch.where(empty, ranked, cost)


# ----------------------------------------------------------------- evaluation (Triton)

if HAVE_TRITON:

    @triton.jit
    def _phi(u, PHI: tl.constexpr):
        if PHI == 0:
            return tl.sqrt(u)
        elif PHI == 1:
            return tl.log2(1.0 + u)
        else:
            return u * (2.0 - u)

    @triton.jit
    def _launch_terms(x, per_block_ptr, slots_ptr, fill_ptr, maxs_ptr, rows, k, valid, WAVE_CEIL: tl.constexpr,
                      PHI: tl.constexpr):
        """(waves, CTAs, phi) of launch k of the variants ``rows`` with ``x`` token blocks."""
        per_block = tl.load(per_block_ptr + rows * 2 + k, mask=valid, other=0)
        slots = tl.load(slots_ptr + rows * 2 + k, mask=valid, other=1)
        fill = tl.load(fill_ptr + rows * 2 + k, mask=valid, other=0)
        maxs = tl.load(maxs_ptr + rows * 2 + k, mask=valid, other=1)
        tiles = x * per_block
        split = tl.where(fill > 0, tl.minimum(tl.maximum(fill // tl.maximum(tiles, 1), 1), maxs), 1)
        G = tiles * split
        u = G.to(tl.float32) / slots.to(tl.float32)
        if WAVE_CEIL:
            waves = ((G + slots - 1) // slots).to(tl.float32)
        else:
            waves = u
        uc = tl.minimum(tl.maximum(u, 0.0), 1.0)
        return waves, G.to(tl.float32), _phi(uc, PHI)

    # The sizes change with every call; their value classes (== 1, multiples of 16) must not
    # select a binary (one compile per model form and expert count, whatever M).
    @triton.jit(do_not_specialize=["num_ids", "num_experts", "capacity", "M", "num_variants"])
    def _select_kernel(ids_ptr, num_ids, counts_ptr, num_experts, capacity, M,
                       bm_index_ptr, direct_ptr, bm_ptr, per_block_ptr, slots_ptr, fill_ptr, maxs_ptr, coef_ptr,
                       empty_rank_ptr, num_variants, out_ptr,
                       FROM_IDS: tl.constexpr, EP: tl.constexpr, BLOCK_IDS: tl.constexpr, BLOCK_V: tl.constexpr,
                       WAVE_CEIL: tl.constexpr, PHI: tl.constexpr):
        """One program: the expert histogram (from ids, or the counts clamped to ``capacity``
        when > 0), every variant's cost, the argmin (the first of equals; of the empty-call
        ranks where the histogram has no pair). out[0] = the best row (as a float32), out[1] =
        its cost."""
        e = tl.arange(0, EP)
        if FROM_IDS:
            hist = tl.zeros((EP,), dtype=tl.int32)
            start = 0
            while start < num_ids:
                offs = start + tl.arange(0, BLOCK_IDS)
                ids = tl.load(ids_ptr + offs, mask=offs < num_ids, other=-1).to(tl.int32)
                ok = (ids >= 0) & (ids < num_experts)
                hist += tl.histogram(tl.where(ok, ids, 0), EP, mask=ok)
                start += BLOCK_IDS
            n = hist
        else:
            n = tl.load(counts_ptr + e, mask=e < num_experts, other=0).to(tl.int32)
            n = tl.maximum(n, 0)
            if capacity > 0:
                n = tl.minimum(n, capacity)
        b16 = tl.sum((n + 15) // 16, 0)
        b32 = tl.sum((n + 31) // 32, 0)
        b64 = tl.sum((n + 63) // 64, 0)
        b128 = tl.sum((n + 127) // 128, 0)
        active = tl.sum((n > 0).to(tl.float32), 0)
        pairs = tl.sum(n.to(tl.float32), 0)
        best_key = tl.full((), float("inf"), tl.float32)
        best = tl.full((), float("inf"), tl.float32)
        best_row = tl.full((), -1, tl.int32)
        v0 = 0
        while v0 < num_variants:
            rows = v0 + tl.arange(0, BLOCK_V)
            valid = rows < num_variants
            bmi = tl.load(bm_index_ptr + rows, mask=valid, other=0)
            x = tl.where(bmi == 0, b16, tl.where(bmi == 1, b32, tl.where(bmi == 2, b64, b128)))
            w0, g0, p0 = _launch_terms(x, per_block_ptr, slots_ptr, fill_ptr, maxs_ptr, rows, 0, valid, WAVE_CEIL, PHI)
            w1, g1, p1 = _launch_terms(x, per_block_ptr, slots_ptr, fill_ptr, maxs_ptr, rows, 1, valid, WAVE_CEIL, PHI)
            c0 = tl.load(coef_ptr + rows * 6 + 0, mask=valid, other=0.0)
            c1 = tl.load(coef_ptr + rows * 6 + 1, mask=valid, other=0.0)
            c2 = tl.load(coef_ptr + rows * 6 + 2, mask=valid, other=0.0)
            c3 = tl.load(coef_ptr + rows * 6 + 3, mask=valid, other=0.0)
            c4 = tl.load(coef_ptr + rows * 6 + 4, mask=valid, other=0.0)
            c5 = tl.load(coef_ptr + rows * 6 + 5, mask=valid, other=0.0)
            cost = c0 + c1 * (w0 + w1) + c2 * (g0 + g1) + c3 * (p0 + p1) + c4 * active + c5 * pairs
            direct = tl.load(direct_ptr + rows, mask=valid, other=0)
            bm = tl.load(bm_ptr + rows, mask=valid, other=1)
            path_ok = (direct < 0) | ((direct == 1) == (M <= bm))
            cost = tl.where(valid & path_ok, cost, float("inf"))
            rank = tl.load(empty_rank_ptr + rows, mask=valid, other=0.0)
            key = tl.where(pairs == 0, tl.where(valid & path_ok, rank, float("inf")), cost)
            chunk_key = tl.min(key, 0)
            at = tl.argmin(key, 0)
            chunk_cost = tl.sum(tl.where(tl.arange(0, BLOCK_V) == at, cost, 0.0), 0)
            take = chunk_key < best_key
            best_row = tl.where(take, (v0 + at).to(tl.int32), best_row)
            best_key = tl.where(take, chunk_key, best_key)
            best = tl.where(take, chunk_cost, best)
            v0 += BLOCK_V
        tl.store(out_ptr, best_row.to(tl.float32))  # exact: rows < 2**24
        tl.store(out_ptr + 1, best)


BLOCK_IDS = 1024
BLOCK_V = 128


def choose_device(dm: DeviceModel, M: int, *, topk_ids: torch.Tensor | None = None,
                  counts: torch.Tensor | None = None, num_experts: int | None = None,
                  use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(best row [0-dim int32], its predicted µs [0-dim float32]) on the device, no host sync:
    from ``topk_ids`` [M, K] (with ``num_experts``) or ``counts`` [E]. ``use_triton`` None:
    the Triton kernel where it compiles for the device (a CUDA device, or the interpreter)."""
    if (topk_ids is None) == (counts is None):
        raise ValueError("give exactly one of topk_ids and counts")
    src = topk_ids if topk_ids is not None else counts
    if use_triton is None:
        use_triton = HAVE_TRITON and (src.is_cuda or _interpreting())
    if topk_ids is not None and num_experts is None:
        raise ValueError("num_experts is needed with topk_ids")
    E = num_experts if topk_ids is not None else counts.shape[0]
    if not use_triton:
        n = histogram(topk_ids, E) if topk_ids is not None else counts
        cost = costs_torch(dm, n, M)
        row = torch.argmin(selection_keys(dm, n, cost))
        return row.to(torch.int32), cost[row]
    out = torch.empty(2, dtype=torch.float32, device=src.device)
    ids = topk_ids.reshape(-1).contiguous() if topk_ids is not None else out
    cnt = counts.contiguous() if counts is not None else out
    _select_kernel[(1,)](
        ids, ids.numel() if topk_ids is not None else 0, cnt, E, dm.capacity, M,
        dm.bm_index, dm.direct, dm.bm, dm.per_block, dm.slots, dm.split_fill, dm.max_splits, dm.coef,
        dm.empty_rank, dm.num_variants, out,
        FROM_IDS=topk_ids is not None, EP=max(16, triton.next_power_of_2(E)), BLOCK_IDS=BLOCK_IDS,
        BLOCK_V=BLOCK_V, WAVE_CEIL=dm.wave_ceil and not dm.ratio_waves, PHI=dm.phi, num_warps=4)
    return out[0].to(torch.int32), out[1]


# ------------------------------------------------------------------------ the selector


class Selector:
    """Chooses a :class:`KernelConfig` for one shape, precision and kernel family on one device.

    ``model``: a fitted :class:`CostModel`, a model file path, or None to look one up
    (:func:`moekit.ramp.modelfile.find_model` for the device's GPU); where none exists the
    region-analysis fallback decides (``self.fallback`` True) and a warning says how to profile.
    ``host_reads`` counts the values read back to the host (one per selection, none on a cache hit).
    """

    def __init__(self, shape: MoEShape, *, dtype=torch.bfloat16, device: torch.device | str | None = None,
                 family: str = "token", model: CostModel | str | os.PathLike | None = None,
                 hardware: Hardware | None = None, capacity: int | None = None, use_triton: bool | None = None,
                 warn: bool = True, any_top_k: bool = False):
        self.shape = shape
        self.dtype_name = dtype_name(dtype)
        self.dtype = _FP8 if self.dtype_name == "float8_e4m3fn" else torch.bfloat16
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
        self.family = family
        self.capacity = capacity
        self.hardware = hardware or hardware_for(device=self.device if self.device.type == "cuda" else None)
        self.use_triton = use_triton
        self.model_path = None
        if model is None:
            path = find_model(shape, self.hardware.key, self.dtype_name, family, any_top_k=any_top_k)
            model = path
        if isinstance(model, (str, os.PathLike)):
            self.model_path = str(model)
            model, _ = load_model(model, shape=shape, gpu=self.hardware.key, dtype=self.dtype_name, family=family,
                                  match_top_k=not any_top_k)
            if any_top_k:
                self.shape = model.shape
        self.model = model
        self.fallback = model is None
        if self.fallback:
            self.configs = templates(shape, self.hardware, self.dtype)
            if family == "expert_major":  # the schedule that follows the counts (kernels.expert_major)
                self.configs = [c for c in self.configs if c.form == "two_launch" and c.split_k == 1] or \
                    [self.static_fallback()]
            if warn:
                warnings.warn(profile_hint(shape, self.hardware.key, self.dtype_name, family,
                                           known_top_k=not any_top_k), stacklevel=3)
        else:
            self.configs = model.configs
        self._dm: DeviceModel | None = None
        # A live selection on a CUDA device replays a CUDA graph of the selection kernel (one
        # per token count): one copy and one replay launched from Python instead of the Triton
        # launch and the small ops around it, which made the eager read host-bound.
        self.graphed_reads = True
        self._graphs: OrderedDict = OrderedDict()  # least recently used first
        self._graph_lock = threading.Lock()  # one graphed read at a time: they share buffers
        self.host_reads = 0
        self.last: KernelConfig | None = None  # what :meth:`auto` answered last
        self._static: dict[int, KernelConfig] = {}
        self._launched: set = set()  # token counts :meth:`auto` has run at
        self._gains: dict[int, tuple[float, float]] = {}
        self.read_cost_us: float | None = None  # None: by the read's mode (GRAPHED_ / EAGER_READ_COST_US)
        self.calls_per_read = 1.0  # calls one read served in the last whole step (read_pays)
        self._step_layers: set = set()
        self._step_keys: set = set()
        self._step_calls = 0
        self._cache: dict = {}
        self._seen: set = set()
        self._explicit_step = 0
        self._lock = threading.Lock()

    # -- evaluation ---------------------------------------------------------------------

    def device_model(self) -> DeviceModel:
        if self._dm is None:
            self._dm = device_model(self.model, self.device, self.capacity)
        return self._dm

    def choose_device(self, M: int, *, topk_ids=None, counts=None) -> torch.Tensor:
        """The chosen config's index into ``self.configs`` as a 0-dim int32 device tensor: no
        host sync (usable inside a CUDA graph). Needs a fitted model."""
        if self.fallback:
            raise ValueError("choose_device needs a fitted model; this selector uses the fallback")
        dm = self.device_model()
        row, _ = choose_device(dm, M, topk_ids=topk_ids, counts=counts, num_experts=self.shape.num_experts,
                               use_triton=self.use_triton)
        return dm.config.index_select(0, row.reshape(1).long())[0]

    def choose(self, M: int, *, topk_ids=None, counts=None) -> KernelConfig:
        """The configuration for this histogram (one host read)."""
        self.host_reads += 1
        if self.fallback:
            n = histogram(topk_ids, self.shape.num_experts) if topk_ids is not None else counts
            vals = n.cpu()
            if self.capacity:
                vals = vals.clamp(max=self.capacity)
            return fallback_choice(self.shape, vals, M, self.hardware, self.dtype, self.configs)
        dm = self.device_model()
        src = topk_ids if topk_ids is not None else counts
        if self.graphed_reads and src.is_cuda:
            row = self._graphed_row(dm, M, topk_ids, counts)
        else:
            row, _ = choose_device(dm, M, topk_ids=topk_ids, counts=counts, num_experts=self.shape.num_experts,
                                   use_triton=self.use_triton)
            row = int(row.item())
        return self.configs[dm.rows[row]]

    def _graphed_row(self, dm: DeviceModel, M: int, topk_ids, counts) -> int:
        """:func:`choose_device`'s row through a CUDA graph captured once per (M, input layout):
        the input is copied into the graph's own buffer, the graph replays, the row is read; one
        read at a time (the buffers are shared). Captured on a side stream with ``capture_begin``
        (not ``torch.cuda.graph``, which empties the caching allocator); the first eager call
        loads the kernel, which a capture may not do. The least recently used graph goes past
        :data:`GRAPHED_READS`."""
        src = topk_ids if topk_ids is not None else counts
        key = (M, topk_ids is not None, tuple(src.shape), src.dtype)
        with self._graph_lock:
            entry = self._graphs.get(key)
            if entry is None:
                entry = self._capture_selection(dm, M, src, topk_ids is not None)
                if len(self._graphs) >= GRAPHED_READS:
                    self._graphs.popitem(last=False)
                self._graphs[key] = entry
            self._graphs.move_to_end(key)
            graph, buf, row = entry
            buf.copy_(src)
            graph.replay()
            return int(row.item())

    def _capture_selection(self, dm: DeviceModel, M: int, src: torch.Tensor, from_ids: bool) -> tuple:
        """(graph, its input buffer, its output row) of one selection at M."""
        buf = src.detach().clone()

        def run():
            return choose_device(dm, M, topk_ids=buf if from_ids else None, counts=None if from_ids else buf,
                                 num_experts=self.shape.num_experts, use_triton=self.use_triton)[0]

        here = torch.cuda.current_stream(src.device)
        side = torch.cuda.Stream(src.device)
        side.wait_stream(here)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            run()
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                row = run()
            finally:
                graph.capture_end()
        here.wait_stream(side)
        return graph, buf, row

    # -- per-step cache -----------------------------------------------------------------

    def new_step(self) -> None:
        """Forget the cached choices: the next selection reads the routing again."""
        with self._lock:
            self._cache.clear()
            self._seen.clear()

    @contextlib.contextmanager
    def step(self):
        """Inside: one selection per token count for every call (one forward step)."""
        self.new_step()
        self._explicit_step += 1
        try:
            yield self
        finally:
            self._explicit_step -= 1
            self.new_step()

    def select(self, *, topk_ids: torch.Tensor | None = None, counts: torch.Tensor | None = None,
               M: int | None = None, layer=None, static: bool = False) -> KernelConfig:
        """:meth:`choose`, cached for the step: keyed by the token count ``M`` (``topk_ids``'
        rows; for ``counts`` give M, or the capacity keys it). ``layer``: a key of the calling
        layer; when it comes back, a new step has begun. ``static``: on a cache miss, cache
        :meth:`static_choice` instead of reading (the first call at M; see the module docstring)."""
        if M is None:
            M = topk_ids.shape[0] if topk_ids is not None else (self.capacity or 0)
        caching = layer is not None or self._explicit_step > 0 or _GLOBAL_STEP.depth > 0
        with self._lock:
            if layer is not None:
                if layer in self._seen:
                    self._cache.clear()
                    self._seen.clear()
                self._seen.add(layer)
            if _GLOBAL_STEP.depth > 0 and self._cache.get("_epoch") != _GLOBAL_STEP.epoch:
                self._cache.clear()
                self._cache["_epoch"] = _GLOBAL_STEP.epoch
            hit = self._cache.get(M) if caching else None
        if hit is not None:
            return hit
        if static:
            config = self.static_choice(M)
        else:
            config = self.choose(M, topk_ids=topk_ids, counts=counts)
        if caching:
            with self._lock:
                self._cache[M] = config
        return config

    def auto(self, M: int, *, topk_ids: torch.Tensor | None = None, counts: torch.Tensor | None = None,
             layer=None, reads: str = "step") -> KernelConfig:
        """What ``config="auto"`` runs: :meth:`select` (one host read per step), except inside a
        CUDA-graph capture and at the first call at ``M``, where the static choice runs (module
        docstring). ``reads="when_pays"``: the static choice also at every M where
        :meth:`read_pays` says no. Sets ``self.last``."""
        if reads not in ("step", "when_pays"):
            raise ValueError(f"reads must be 'step' or 'when_pays', got {reads!r}")
        src = topk_ids if topk_ids is not None else counts
        self._note_call(M, layer)
        with self._lock:
            first = M not in self._launched
            self._launched.add(M)
        if src.is_cuda and torch.cuda.is_current_stream_capturing():
            config = self.static_choice(M)
        elif reads == "when_pays" and not first and not self.read_pays(M):
            config = self.static_choice(M)
        else:
            config = self.select(topk_ids=topk_ids, counts=counts, M=M, layer=layer, static=first)
        self.last = config
        return config

    def _note_call(self, M: int, layer) -> None:
        """Counts the calls and token counts of a step of layer-keyed calls (a layer key coming
        back ends it), for ``calls_per_read``: how many calls one read at a token count served.
        Calls without a layer key are not counted (``calls_per_read`` stays as it was)."""
        if layer is None:
            return
        with self._lock:
            if layer in self._step_layers:
                self.calls_per_read = self._step_calls / max(1, len(self._step_keys))
                self._step_layers.clear()
                self._step_keys.clear()
                self._step_calls = 0
            self._step_layers.add(layer)
            self._step_keys.add(M)
            self._step_calls += 1

    def read_pays(self, M: int) -> bool:
        """Whether reading the routing at M is predicted to save more than it costs:
        :meth:`read_value_us` against ``read_cost_us`` (None: the measured cost of the read's
        mode, graphed or eager). Never without a fitted model."""
        if self.fallback:
            return False
        cost = self.read_cost_us
        if cost is None:
            cost = GRAPHED_READ_COST_US if self.graphed_reads else EAGER_READ_COST_US
        return self.read_value_us(M) >= cost

    def read_value_us(self, M: int) -> float:
        """The predicted time one read saves a step at M: the gain on the routing it read, plus
        the gain on each other call it serves (``calls_per_read`` - 1 of them, from the last
        whole step), whose routing it did not read (:meth:`read_gains_us`)."""
        same, other = self.read_gains_us(M)
        return same + max(0.0, self.calls_per_read - 1) * other

    def read_gain_us(self, M: int) -> float:
        """The model's mean predicted time saved per call at M by the live choice over the static
        one, on the routing it was made for (µs): :meth:`read_gains_us`' first value."""
        return self.read_gains_us(M)[0]

    def read_gains_us(self, M: int) -> tuple[float, float]:
        """(same, other), µs, from the model over :func:`moekit.ramp.graphs.routing_sweep` at M
        with two seeds, once per M. ``same``: the mean time the choice made for a routing saves
        on that routing, against :meth:`static_choice`. ``other``: what it saves on a routing of
        the same skew drawn with the other seed -- the other layers of a step, which share the
        token count and, by the paper's per-step argument, the skew, but not the experts. It can
        be negative (the read's choice loses there)."""
        with self._lock:
            hit = self._gains.get(M)
        if hit is not None:
            return hit
        gains = (0.0, 0.0)
        static = self.static_choice(M)
        if not self.fallback and static in self.configs:
            from moekit.ramp.graphs import routing_sweep

            hists = routing_sweep(self, max(1, M), seeds=2)
            preds = self._predictions(hists, M)
            s = self.configs.index(static)
            best = np.array([self.model.choose_predicted(h, M, p) for h, p in zip(hists, preds)])
            half = len(preds) // 2
            other = np.concatenate([best[half:], best[:half]])  # the same skew, the other seed
            rows = np.arange(len(preds))
            gain_same, gain_other = preds[:, s] - preds[rows, best], preds[:, s] - preds[rows, other]
            if np.isfinite(gain_same).all() and np.isfinite(gain_other).all():
                gains = (float(gain_same.mean()), float(gain_other.mean()))
        with self._lock:
            self._gains[M] = gains
        return gains

    def _predictions(self, hists: list[np.ndarray], M: int) -> np.ndarray:
        """[routings, configs] predicted µs (inf where a config has no fitted variant), the
        counts clamped to the capacity."""
        if self.capacity:
            hists = [np.minimum(h, self.capacity) for h in hists]
        preds = np.stack([self.model.predict(h, M) for h in hists])
        return np.where(np.isfinite(preds), preds, np.inf)

    def static_fallback(self, M: int | None = None) -> KernelConfig:
        """The kernel's own default for M (the capacity for the expert-major family)."""
        if self.family == "expert_major":
            from moekit.kernels.expert_major import expert_major_default

            return expert_major_default(self.capacity or M or 1, self.dtype == _FP8)
        from moekit.kernels.configs import default_config

        return default_config(M or 1, self.shape, dtype=self.dtype)

    def static_choice(self, M: int) -> KernelConfig:
        """The configuration for token count (or capacity) ``M`` whatever the routing, computed
        on the host alone, once per M: with a fitted model, the least mean predicted time over
        :func:`moekit.ramp.graphs.routing_sweep`'s histograms (one seed: the sweep is paid once
        per token count); without one, the kernel's default for M (``default_config`` /
        ``expert_major_default``), whose choices were measured -- the fallback's estimate needs
        a histogram."""
        with self._lock:
            hit = self._static.get(M)
        if hit is not None:
            return hit
        config = None
        if not self.fallback:
            from moekit.ramp.graphs import routing_sweep

            mean = self._predictions(routing_sweep(self, max(1, M), seeds=1), M).mean(axis=0)
            if np.isfinite(mean).any():  # else no config has a fitted variant at M
                config = self.configs[int(np.argmin(mean))]
        if config is None:
            config = self.static_fallback(M)
        with self._lock:
            self._static[M] = config
        return config


def profile_hint(shape: MoEShape, gpu: str, dtype: str, family: str, known_top_k: bool = True) -> str:
    """The one-time warning of a selector without a model file (``known_top_k`` False: the
    caller does not know the router's K, the command says K)."""
    dt = {"bfloat16": "bf16", "float8_e4m3fn": "fp8", "float16": "fp16"}[dtype]
    fam = "" if family == "token" else f" --family {family}"
    k = shape.top_k if known_top_k else "K"
    name = model_filename(gpu, shape, dtype, family)
    if not known_top_k:
        name = name.replace(f"-K{shape.top_k}-", "-K<any>-")
    dims = f"E={shape.num_experts}{f' K={k}' if known_top_k else ''} H={shape.hidden} N={shape.intermediate}"
    return (f"moekit.ramp: no fitted model for {dims} {dtype} on {gpu} ({name}); the "
            "configuration comes from the region analysis, which is slower than a fitted model. Profile it "
            "on this GPU (about 5 minutes for 317 configs on an H100): "
            f"moekit ramp profile --experts {shape.num_experts} --top-k {k} "
            f"--hidden {shape.hidden} --intermediate {shape.intermediate} --dtype {dt}{fam} --out-dir DIR, "
            f"then export MOEKIT_RAMP_MODELS=DIR")


# ------------------------------------------------------------ process-wide selectors


class _Step:
    def __init__(self):
        self.depth = 0
        self.epoch = 0


_GLOBAL_STEP = _Step()
_SELECTORS: dict[tuple, Selector] = {}
_MODELLESS: set = set()  # keys model_selector_for found no model file for
_SELECTORS_LOCK = threading.Lock()


@contextlib.contextmanager
def step():
    """One forward step for every selector: inside, each chooses once per token count."""
    _GLOBAL_STEP.epoch += 1
    _GLOBAL_STEP.depth += 1
    try:
        yield
    finally:
        _GLOBAL_STEP.depth -= 1
        _GLOBAL_STEP.epoch += 1


def forget_selectors() -> None:
    """Drop the process-wide selectors and what :func:`model_selector_for` found missing (after
    model files were added or ``MOEKIT_RAMP_MODELS`` changed)."""
    with _SELECTORS_LOCK:
        _SELECTORS.clear()
        _MODELLESS.clear()


def _selector_key(E: int, K: int | None, H: int, N: int, dtype, device, family: str, capacity: int | None) -> tuple:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return (E, K, H, N, dtype_name(dtype), str(device), family, capacity)


def selector_for(E: int, K: int | None, H: int, N: int, *, dtype, device, family: str = "token",
                 capacity: int | None = None) -> Selector:
    """The process-wide selector of this shape, precision, family and device (made once; the
    fallback's warning is given once per key). ``K`` None (expert_major only): the caller does
    not know the router's K; a model file of any K serves (:func:`find_model`)."""
    if K is None and family != "expert_major":
        raise ValueError("K (top_k) is needed for the token family")
    key = _selector_key(E, K, H, N, dtype, device, family, capacity)
    with _SELECTORS_LOCK:
        sel = _SELECTORS.get(key)
        if sel is None:
            # K = 1 stands in for an unknown K (the fallback's templates barely depend on it).
            shape = MoEShape("adhoc", E, K or 1, H, N)
            sel = _SELECTORS[key] = Selector(shape, dtype=dtype, device=torch.device(key[5]), family=family,
                                             capacity=capacity, any_top_k=K is None)
    return sel


def model_selector_for(E: int, K: int | None, H: int, N: int, *, dtype, device, family: str = "token",
                       capacity: int | None = None) -> Selector | None:
    """:func:`selector_for` where a fitted model file of this shape exists for the device's GPU;
    None (and no warning) where none does: the caller keeps its own static default."""
    key = _selector_key(E, K, H, N, dtype, device, family, capacity)
    with _SELECTORS_LOCK:
        sel = _SELECTORS.get(key)
        if sel is not None:
            return None if sel.fallback else sel
        if key in _MODELLESS:
            return None
    dev = torch.device(key[5])
    gpu = hardware_for(device=dev if dev.type == "cuda" else None).key
    if find_model(MoEShape("adhoc", E, K or 1, H, N), gpu, key[4], family, any_top_k=K is None) is None:
        with _SELECTORS_LOCK:
            _MODELLESS.add(key)
        return None
    return selector_for(E, K, H, N, dtype=dtype, device=dev, family=family, capacity=capacity)


def _weight_dims(w13: torch.Tensor, w2: torch.Tensor) -> tuple[int, int, int, torch.dtype]:
    """(E, H, N, the model's precision) of the experts' weights: e4m3 weights select FP8 models."""
    return w13.shape[0], w13.shape[2], w2.shape[2], _FP8 if w13.dtype == _FP8 else torch.bfloat16


def auto_config(topk_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *, layer=None) -> KernelConfig:
    """``fused_moe(..., config="auto")``: the config for this call's routing (weights give the
    shape and precision: FP8 weights select the FP8 model)."""
    E, H, N, dtype = _weight_dims(w13, w2)
    sel = selector_for(E, topk_ids.shape[1], H, N, dtype=dtype, device=topk_ids.device)
    return sel.auto(topk_ids.shape[0], topk_ids=topk_ids, layer=layer)


def ramp_config(topk_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *, layer=None) -> KernelConfig | None:
    """The ``"ramp"`` policy of a token-major call: where a fitted model of this shape exists for
    the GPU, RaMP's choice with ``reads="when_pays"``; None where none does (the caller runs its
    static choice)."""
    E, H, N, dtype = _weight_dims(w13, w2)
    sel = model_selector_for(E, topk_ids.shape[1], H, N, dtype=dtype, device=topk_ids.device)
    return None if sel is None else sel.auto(topk_ids.shape[0], topk_ids=topk_ids, layer=layer, reads="when_pays")


def auto_config_expert_major(counts: torch.Tensor, capacity: int, w13: torch.Tensor, w2: torch.Tensor, *,
                             top_k: int | None = None, layer=None) -> KernelConfig:
    """``fused_moe_expert_major(..., config="auto")`` / ``FusedExperts(config="auto")``: the
    config for a dispatcher's ``counts`` (one per local expert), keyed by the capacity.
    ``top_k``: the router's K where known (it names the model file; None: any K's file)."""
    E, H, N, dtype = _weight_dims(w13, w2)
    sel = selector_for(E, top_k, H, N, dtype=dtype, device=counts.device, family="expert_major", capacity=capacity)
    return sel.auto(capacity, counts=counts, layer=layer)


def ramp_config_expert_major(counts: torch.Tensor, capacity: int, w13: torch.Tensor, w2: torch.Tensor, *,
                             top_k: int | None = None, layer=None) -> KernelConfig | None:
    """``FusedExperts``' default: where a fitted model of this shape exists for the GPU, RaMP's
    choice with ``reads="when_pays"`` (the static choice, and a live read only at capacities
    where the model predicts it pays); None where no model exists (the caller runs its default)."""
    E, H, N, dtype = _weight_dims(w13, w2)
    sel = model_selector_for(E, top_k, H, N, dtype=dtype, device=counts.device, family="expert_major",
                             capacity=capacity)
    return None if sel is None else sel.auto(capacity, counts=counts, layer=layer, reads="when_pays")
