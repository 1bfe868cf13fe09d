"""Token alignment: group the (token, slot) pairs by expert and pad each expert to the token block.

The kernel runs one CTA per block of ``bm`` rows of one expert. Alignment produces

* ``sorted_ids[capacity]`` int32: pair ids ``token * K + slot`` grouped by expert (experts in
  increasing order, pairs inside an expert by (token, slot)), each expert's segment padded with
  the sentinel ``M * K`` up to a multiple of ``bm``; everything past the real end is sentinel;
* ``block_expert[capacity // bm]`` int32: the expert of each block, -1 past the real end
  (and, in :func:`align_expert_major`'s fixed layout, on blocks with no valid row): a block
  with -1 exits at once;
* ``num_padded[1]`` int32: the real padded length (a multiple of ``bm``).

Only -1 means a masked slot. An id outside [-1, E) (compared at the ids' own width, so an
int64 ``2**40`` does not wrap onto a real expert) is aligned as expert 0, and the kernels give
that slot a NaN routing weight (:func:`expert_of`): the token's output row comes out NaN, so a
bad id shows in the result without a host read, and nothing is silently dropped.

Everything stays on the device and no size depends on the routing: ``capacity`` is the upper
bound ``M*K + min(E, M*K) * (bm - 1)`` rounded up to ``bm`` (every non-empty expert wastes at
most ``bm - 1`` rows), so the grid can be launched at ``capacity // bm`` blocks without reading
anything back to the host (no sync, CUDA-graph friendly); blocks past ``num_padded`` exit at
once. Masked slots (id -1) are left out.

Two implementations with the same output, bit for bit:

* :func:`align_tokens_triton`, the one :func:`align_tokens` uses wherever Triton runs (GPU, or
  the CPU interpreter): one or two launches. At decode sizes alignment is pure launch overhead, and
  the torch version's ~10 small kernels cost more than the expert GEMMs of a one-token batch
  (docs/kernel.md). Up to ``_MAX_SCAN``
  pairs (M <= 128 at top-8) it is one launch of one program, which does all of the below
  itself; above that:
  1. ``_count_chunks``: one program per chunk of ``SCAN`` pairs writes the chunk's expert
     histogram and fills a slice of ``sorted_ids`` with the sentinel.
  2. ``_scatter_chunks``: every program sums the histograms (the totals give each expert's
     padded start; the chunks before its own give the running offset), sorts its chunk by
     (expert, position) with ``tl.sort`` so the order inside an expert stays (token, slot),
     and scatters the pair ids to their rows; it also writes a slice of ``block_expert``.
  Stream order separates the sentinel fill from the scatter; no atomics, so the result is
  deterministic.
* :func:`align_tokens_torch`: torch ops (a stable sort, a scatter-add histogram, cumsums and
  a searchsorted), used where Triton is missing, and a second implementation for the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Triton is optional: the package imports without it (align_tokens then uses torch).
from moekit.kernels.backend import HAVE_TRITON, interpreting, require_triton, tl, triton
from moekit.kernels.bound import launch as bound_launch


@dataclass
class Alignment:
    """The padded expert-grouped row order the kernel walks (see the module docstring)."""

    sorted_ids: torch.Tensor  # [capacity] int32, pair ids; sentinel = num_pairs
    block_expert: torch.Tensor  # [capacity // bm] int32, -1 where the block has no work
    num_padded: torch.Tensor  # [1] int32
    bm: int
    num_pairs: int  # M*K (or E*capacity in expert-major): the sentinel value
    zeroed: bool = False  # whether the alignment's launches also zeroed the buffer it was given
    topk_ids: torch.Tensor | None = None  # the routing aligned (token-major), read back for its bad ids
    num_experts: int = 0

    @property
    def capacity(self) -> int:
        return self.sorted_ids.shape[0]

    @property
    def max_blocks(self) -> int:
        return self.block_expert.shape[0]

    def kernel_args(self) -> tuple[tuple, dict]:
        """(addressing arguments, constexprs) of the expert kernels (``fused_moe._block_rows``).
        The routing ids (where there are some) let the down-projection find each row's bad id
        (:func:`expert_of`); the expert-major layout has none and never reads the pointer."""
        ids = self.sorted_ids if self.topk_ids is None else self.topk_ids
        return ((self.sorted_ids, self.block_expert, self.num_padded, self.num_pairs, ids, 0, 1, self.num_experts),
                dict(DIRECT=False, KP=1, BINS=16))


@dataclass
class DirectBlocks:
    """Direct addressing, the alternative to an :class:`Alignment` when every token fits one
    block (``M <= bm``): no alignment is computed at all.

    Each expert that the routing names then has at most ``M <= bm`` pairs, so it needs exactly
    one block in any case. Block ``j`` of the kernels serves the ``j``-th smallest named expert,
    found by every program from the ``[M, K]`` ids themselves (one histogram of at most
    ``bm * K`` ids), and its rows are the tokens (row ``i`` = token ``i``, masked where the token
    did not pick that expert). The grid is ``min(E, M*K)`` blocks, the most experts that can be
    named; blocks past the named count exit at once. This saves the alignment's launch, which at
    decode sizes is a fixed cost of the same order as streaming a few experts' weights.
    """

    topk_ids: torch.Tensor  # [M, K] int32/int64, contiguous
    num_experts: int
    bm: int

    @property
    def num_pairs(self) -> int:
        return self.topk_ids.numel()

    @property
    def max_blocks(self) -> int:
        return min(self.num_experts, self.num_pairs)

    @property
    def capacity(self) -> int:
        return self.max_blocks * self.bm

    def kernel_args(self) -> tuple[tuple, dict]:
        """(addressing arguments, constexprs) of the expert kernels (``fused_moe._block_rows``)."""
        ids = self.topk_ids
        M, K = ids.shape
        return ((ids, ids, ids, self.num_pairs, ids, M, K, self.num_experts),
                dict(DIRECT=True, KP=_pow2_at_least(K), BINS=_pow2_at_least(self.num_experts, 16)))


def direct_blocks(topk_ids: torch.Tensor, num_experts: int, bm: int) -> DirectBlocks:
    """The :class:`DirectBlocks` of ``topk_ids[M, K]``; needs ``M <= bm`` (ValueError otherwise)."""
    _check_align_args(topk_ids, num_experts, bm)
    if topk_ids.shape[0] > bm:
        raise ValueError(f"direct addressing needs every token in one block: M={topk_ids.shape[0]} > bm={bm}")
    return DirectBlocks(topk_ids.contiguous(), num_experts, bm)


def padded_capacity(num_pairs: int, num_experts: int, bm: int) -> int:
    """Upper bound of the padded length, rounded up to a multiple of ``bm``."""
    bound = num_pairs + min(num_experts, num_pairs) * (bm - 1)
    return -(-bound // bm) * bm


def _check_align_args(topk_ids: torch.Tensor, num_experts: int, bm: int) -> None:
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [M, K], got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if bm < 1:
        raise ValueError(f"bm must be >= 1, got {bm}")


def align_tokens(topk_ids: torch.Tensor, num_experts: int, bm: int, *,
                 zero: torch.Tensor | None = None) -> Alignment:
    """Sort the pairs of ``topk_ids[M, K]`` by expert and pad each expert to ``bm`` (no host sync).

    -1 is a masked slot; any other id outside [-1, num_experts) is aligned as expert 0 (module
    docstring: the kernels give it a NaN weight). Runs the Triton kernels where
    Triton can run on the ids' device, else the torch ops; both give the same tensors.

    ``zero``: a contiguous float32 buffer the caller needs zeroed (the kernels' accumulator).
    Where the alignment takes two launches, its first one also zeroes it (extra programs of
    the same grid), which saves the caller a launch; ``Alignment.zeroed`` says whether it did.
    """
    if HAVE_TRITON and (topk_ids.is_cuda or interpreting()):
        return align_tokens_triton(topk_ids, num_experts, bm, zero=zero)
    return align_tokens_torch(topk_ids, num_experts, bm)


def _pow2_at_least(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, (n - 1).bit_length()))


_MAX_SCAN = 1024  # pairs per chunk: one tl.sort of this size per program
_BLOCK_TILE = 32  # blocks per step of the block_expert search (a [32, bins] compare)
_FILL = 1024  # sentinel stores per step


if HAVE_TRITON:

    @triton.jit
    def expert_of(raw, num_experts):
        """(the expert the kernels route ``raw`` ids to, int32; which of them are bad). -1, the
        masked slot, stays -1; an id outside [-1, num_experts), compared before any narrowing,
        goes to expert 0 and is flagged, so that its slot gets a NaN weight (module docstring)."""
        bad = (raw < -1) | (raw >= num_experts)
        return tl.where(bad, 0, raw).to(tl.int32), bad

    @triton.jit
    def _chunk_keys(ids_ptr, chunk, num_pairs, num_experts, SCAN: tl.constexpr):
        """Pair positions and expert ids of chunk ``chunk``; valid False past the end and on -1."""
        pos = chunk * SCAN + tl.arange(0, SCAN)
        e, _ = expert_of(tl.load(ids_ptr + pos, mask=pos < num_pairs, other=-1), num_experts)
        return pos, e, e >= 0

    @triton.jit
    def _fill_sentinel(sorted_ptr, lo, hi, num_pairs, FILL: tl.constexpr, FILL_STEPS: tl.constexpr):
        """sorted_ids[lo:hi] = num_pairs (the padding sentinel)."""
        for step in range(FILL_STEPS):
            rows = lo + step * FILL + tl.arange(0, FILL)
            tl.store(sorted_ptr + rows, tl.full([FILL], 0, tl.int32) + num_pairs, mask=rows < hi)

    # The int arguments are sizes that change with M; specializing on them (==1, %16) would only
    # multiply the compiled variants.
    @triton.jit(do_not_specialize=["num_pairs", "num_experts", "cap", "fill_per_prog", "num_chunks", "zero_n"])
    def _count_chunks(ids_ptr, hist_ptr, sorted_ptr, zero_ptr, num_pairs, num_experts, cap, fill_per_prog,
                      num_chunks, zero_n, SCAN: tl.constexpr, BINS: tl.constexpr, FILL: tl.constexpr,
                      FILL_STEPS: tl.constexpr, ZERO_BLOCK: tl.constexpr):
        """Program c < num_chunks: histogram of chunk c -> hist[c, :]; sentinel into its slice of
        sorted_ids. Programs past them (where the caller gave a buffer to zero): zero_ptr's
        ZERO_BLOCK-element block c - num_chunks."""
        c = tl.program_id(0)
        if c >= num_chunks:
            offs = (c - num_chunks).to(tl.int64) * ZERO_BLOCK + tl.arange(0, ZERO_BLOCK)
            tl.store(zero_ptr + offs, tl.zeros([ZERO_BLOCK], tl.float32), mask=offs < zero_n)
        else:
            _, e, valid = _chunk_keys(ids_ptr, c, num_pairs, num_experts, SCAN)
            tl.store(hist_ptr + c * BINS + tl.arange(0, BINS),
                     tl.histogram(tl.where(valid, e, 0), BINS, mask=valid))
            lo = c * fill_per_prog
            _fill_sentinel(sorted_ptr, lo, tl.minimum(lo + fill_per_prog, cap), num_pairs, FILL, FILL_STEPS)

    @triton.jit(do_not_specialize=["num_pairs", "num_experts", "num_chunks", "bm", "cap", "num_blocks",
                                   "blocks_per_prog"])
    def _scatter_chunks(ids_ptr, hist_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
                        num_pairs, num_experts, num_chunks, bm, cap, num_blocks, blocks_per_prog,
                        SCAN: tl.constexpr, BINS: tl.constexpr, CHUNK_STEPS: tl.constexpr,
                        BLOCK_TILE: tl.constexpr, BLOCK_STEPS: tl.constexpr,
                        ONE_CHUNK: tl.constexpr, FILL: tl.constexpr, FILL_STEPS: tl.constexpr):
        """Program c: rows of chunk c's pairs, and block_expert for blocks of its slice.

        ONE_CHUNK (a single program, the decode sizes): the whole alignment in this one launch;
        the histogram is the program's own and it fills the sentinel itself, before a barrier
        that orders those stores ahead of the scatter's (hist_ptr is then not read).
        """
        c = tl.program_id(0)
        bins = tl.arange(0, BINS)
        pos, e, valid = _chunk_keys(ids_ptr, c, num_pairs, num_experts, SCAN)
        own = tl.histogram(tl.where(valid, e, 0), BINS, mask=valid)
        if ONE_CHUNK:
            total = own
            before = tl.zeros([BINS], tl.int32)
            _fill_sentinel(sorted_ptr, 0, cap, num_pairs, FILL, FILL_STEPS)
            tl.debug_barrier()
        else:
            total = tl.zeros([BINS], tl.int32)
            before = tl.zeros([BINS], tl.int32)  # pairs of each expert in the chunks before c
            for j in range(CHUNK_STEPS):
                h = tl.load(hist_ptr + j * BINS + bins, mask=j < num_chunks, other=0)
                total += h
                before += tl.where(j < c, h, 0)
        counts = tl.where(bins < num_experts, total, 0)
        padded = (counts + bm - 1) // bm * bm
        pend = tl.cumsum(padded, 0)
        pstart = pend - padded

        # Scatter. Sorting (expert, position) keys puts the chunk's pairs in their final
        # relative order; sorted index s of a pair of expert e is its rank in the chunk among
        # pairs of experts <= e, so its row is pstart[e] + before[e] + (s - first[e]), where
        # first[e] = the chunk's pairs of experts < e. Invalid slots get key BINS - 1 >= E.
        key = tl.where(valid, e, BINS - 1) * SCAN + (pos - c * SCAN)
        key = tl.sort(key)
        e_s = key // SCAN
        pair = c * SCAN + key % SCAN
        first = tl.cumsum(own, 0) - own
        base = pstart + before - first
        row = tl.gather(base, e_s, 0) + tl.arange(0, SCAN)
        tl.store(sorted_ptr + row, pair, mask=e_s < num_experts)

        # block_expert for blocks b of this program's slice: the expert whose padded segment
        # holds row b * bm is the number of experts ending at or before it (-1 past the end).
        pend_blocks = tl.where(bins < num_experts, pend // bm, num_blocks + 1)
        for step in range(BLOCK_STEPS):
            b = c * blocks_per_prog + step * BLOCK_TILE + tl.arange(0, BLOCK_TILE)
            ok = (b < (c + 1) * blocks_per_prog) & (b < num_blocks)
            eb = tl.sum((pend_blocks[None, :] <= b[:, None]).to(tl.int32), axis=1)
            tl.store(block_expert_ptr + b, tl.where(eb < num_experts, eb, -1), mask=ok)
        if c == 0:
            tl.store(num_padded_ptr, tl.sum(padded))


_ZERO_BLOCK = 2048  # float32 elements each zeroing program of _count_chunks clears


def align_launches(num_pairs: int) -> int:
    """The Triton launches :func:`align_tokens_triton` takes for ``num_pairs`` pairs."""
    return 1 if num_pairs <= _MAX_SCAN else 2


def align_tokens_triton(topk_ids: torch.Tensor, num_experts: int, bm: int, *,
                        zero: torch.Tensor | None = None) -> Alignment:
    """:func:`align_tokens` in one or two Triton launches (see the module docstring; ``zero``:
    there)."""
    require_triton()
    _check_align_args(topk_ids, num_experts, bm)
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    cap = padded_capacity(num_pairs, num_experts, bm)
    num_blocks = cap // bm
    sorted_ids = torch.empty(cap, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)  # written by the kernel: no memset
    ids = topk_ids.contiguous()
    al = Alignment(sorted_ids, block_expert, num_padded, bm, num_pairs, topk_ids=ids, num_experts=num_experts)
    if num_pairs == 0:
        num_padded.zero_()
        return al
    # Trip counts are constexpr (the interpreter cannot loop over a run-time argument), rounded
    # up to powers of two so that a run of batch sizes shares a few compiled variants.
    scan = min(_MAX_SCAN, _pow2_at_least(num_pairs, 16))
    chunks = -(-num_pairs // scan)
    bins = _pow2_at_least(num_experts + 1, 16)  # one spare bin: invalid slots sort after every expert
    fill_per_prog = -(-cap // chunks)
    blocks_per_prog = -(-num_blocks // chunks)
    one = chunks == 1
    hist = torch.empty(chunks if not one else 1, bins, dtype=torch.int32, device=device)
    fill = dict(FILL=_FILL, FILL_STEPS=_pow2_at_least(-(-(cap if one else fill_per_prog) // _FILL)))
    if not one:
        zero_n = 0 if zero is None else zero.numel()
        zero_progs = -(-zero_n // _ZERO_BLOCK)
        bound_launch(_count_chunks, (chunks + zero_progs,), ids, hist, sorted_ids, sorted_ids if zero is None else zero,
                     num_pairs, num_experts, cap, fill_per_prog, chunks, zero_n,
                     SCAN=scan, BINS=bins, **fill, ZERO_BLOCK=_ZERO_BLOCK, num_warps=4)
        al.zeroed = zero is not None
    bound_launch(_scatter_chunks, (chunks,), ids, hist, sorted_ids, block_expert, num_padded,
                 num_pairs, num_experts, chunks, bm, cap, num_blocks, blocks_per_prog,
                 SCAN=scan, BINS=bins, CHUNK_STEPS=_pow2_at_least(chunks),
                 BLOCK_TILE=_BLOCK_TILE,
                 BLOCK_STEPS=_pow2_at_least(-(-blocks_per_prog // _BLOCK_TILE)),
                 ONE_CHUNK=one, **fill, num_warps=4 if scan <= 256 else 8)
    return al


def align_tokens_torch(topk_ids: torch.Tensor, num_experts: int, bm: int) -> Alignment:
    """:func:`align_tokens` in torch ops (several small kernels): sort the pairs of
    ``topk_ids[M, K]`` by expert and pad each expert to ``bm`` (no host sync).

    Ids outside [-1, num_experts) are aligned as expert 0, as the Triton kernels do.
    """
    _check_align_args(topk_ids, num_experts, bm)
    device = topk_ids.device
    E = num_experts
    num_pairs = topk_ids.numel()
    cap = padded_capacity(num_pairs, E, bm)

    flat = topk_ids.reshape(-1).to(torch.int64)
    flat = torch.where((flat < -1) | (flat >= E), 0, flat)  # bad ids: expert 0 (module docstring)
    # Masked slots get key E, so they sort after every real expert and fall into a dump bin.
    key = torch.where(flat >= 0, flat, torch.full_like(flat, E))
    # Stable sort: inside one expert the pairs keep their flat order token*K + slot, which is
    # the (token, slot) order the tests (and the dispatch layout) expect.
    key_sorted, order = torch.sort(key, stable=True)

    # Per-expert counts by scatter-add (torch.bincount would read the max back to the host).
    counts = torch.zeros(E + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:E]
    padded = (counts + bm - 1) // bm * bm
    start = torch.cumsum(counts, 0) - counts  # first sorted position of each expert
    pstart = torch.cumsum(padded, 0) - padded  # first padded row of each expert

    # Destination of the i-th sorted pair: its expert's padded start + its rank in the expert.
    # Masked pairs (key E) are sent to a dump row at index cap, cut off below.
    pos = torch.arange(num_pairs, device=device)
    e_sorted = key_sorted.clamp(max=E - 1)
    dest = pstart[e_sorted] + (pos - start[e_sorted])
    dest = torch.where(key_sorted < E, dest, torch.full_like(dest, cap))

    sorted_ids = torch.full((cap + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    sorted_ids = sorted_ids[:cap]

    # Expert of each block: the number of experts whose padded segment ends at or before the
    # block's first row. Blocks at or past the total padded length get -1.
    pend_blocks = torch.cumsum(padded, 0) // bm
    blocks = torch.arange(cap // bm, device=device, dtype=torch.int64)
    block_expert = torch.searchsorted(pend_blocks, blocks, right=True)
    block_expert = torch.where(block_expert < E, block_expert, torch.full_like(block_expert, -1))
    num_padded = padded.sum().reshape(1)
    return Alignment(sorted_ids, block_expert.to(torch.int32), num_padded.to(torch.int32), bm, num_pairs,
                     topk_ids=topk_ids.contiguous(), num_experts=E)


def align_expert_major(counts: torch.Tensor, capacity: int, bm: int) -> Alignment:
    """The alignment of an expert-major buffer ``[E_local, capacity, H]`` (rows already grouped).

    Row ``r`` of expert ``e`` is pair id ``e * capacity + r``. Each expert gets
    ``ceil(capacity / bm)`` blocks whether it uses them or not (the buffer is sized for the
    worst case anyway); rows at or past ``counts[e]`` are sentinels. A block with no valid
    row gets expert -1, so the kernels exit at once there instead of streaming the expert's
    weights for nothing (after a dispatcher most blocks are empty: at decode a rank's
    receive buffer holds a few rows for a few of its experts).
    """
    if counts.dim() != 1:
        raise ValueError(f"counts must be [E_local], got shape {tuple(counts.shape)}")
    E = counts.shape[0]
    device = counts.device
    per_expert = -(-capacity // bm) * bm
    num_pairs = E * capacity
    rows = torch.arange(per_expert, device=device)
    ids = torch.arange(E, device=device).unsqueeze(1) * capacity + rows
    used = counts.to(torch.int64).clamp(max=capacity).unsqueeze(1)
    sorted_ids = torch.where(rows < used, ids, torch.full_like(ids, num_pairs)).reshape(-1).to(torch.int32)
    block_rows = torch.arange(0, per_expert, bm, device=device)  # each block's first row
    experts = torch.arange(E, device=device).unsqueeze(1)
    block_expert = torch.where(block_rows < used, experts, -1).reshape(-1).to(torch.int32)
    num_padded = torch.full((1,), E * per_expert, dtype=torch.int32, device=device)
    return Alignment(sorted_ids, block_expert, num_padded, bm, num_pairs)
