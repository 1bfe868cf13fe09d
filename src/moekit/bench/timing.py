"""Timing primitives for every ``moekit bench`` command.

All functions return per-iteration samples in microseconds, warm-up excluded, ready for
:func:`moekit.bench.stats.summarize`.

* :func:`time_fn` — CUDA events on a GPU, ``time.perf_counter_ns`` on the CPU.
* :func:`time_graph_replay` — capture ``fn`` in a CUDA graph and time its replays, which
  removes the host's launch gaps from the numbers (what a graph-captured serving path sees).
* :func:`time_distributed` — one timed region on every rank, ranks aligned before each
  iteration; a collective's latency is that of its slowest rank.
* :class:`PhaseTimer` — named phases inside one iteration (e.g. pack / all-to-all / unpack).
* :func:`queue_timed` — the one queued timer: iterations queued ahead of the GPU behind a
  sleep, so the samples are GPU time even where the host launches slower than the GPU runs;
  :func:`time_cold` / :func:`queue_cold` add an L2 flush before each iteration.

Device work is asynchronous, so on CUDA we never read a host clock: each iteration is
bracketed by a pair of CUDA events on the current stream, and the host waits once, after
the last iteration. CUDA events resolve about half a microsecond. Work that ``fn`` issues
on another stream is only inside the measurement if ``fn`` makes the current stream wait
for it before returning.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


def _check_counts(iters: int, warmup: int) -> None:
    if not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be an int >= 1, got {iters!r}")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")


def _resolve_device(device: torch.device | str | int | None) -> torch.device:
    """The device whose clock times the work: CUDA if available and none was named."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device={device} was asked for but CUDA is not available")
    return device


def _require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{what} needs a CUDA GPU, and torch.cuda.is_available() is False; "
            "on the CPU, time with time_fn(..., device='cpu') instead"
        )


def _timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


def _elapsed_us(starts: list, ends: list) -> list[float]:
    """Read event pairs (already completed) as microseconds; elapsed_time is in ms."""
    return [start.elapsed_time(end) * 1e3 for start, end in zip(starts, ends)]


def _queue_with_events(
    fns: Sequence[Callable[[], object]], iters: int, device: torch.device, before_each=None
) -> Callable[[], list[list[float]]]:
    """Per iteration, call ``fns`` back to back with a CUDA event before the first and after
    each, without waiting for the GPU.

    Returns a function that waits for the last event and gives, per fn, its samples (µs).
    ``before_each`` runs before the first event of an iteration (outside the timed region):
    :func:`time_distributed` aligns the ranks with it, :func:`queue_timed` queues its sleeps
    and the caller's untimed work.
    """
    with torch.cuda.device(device):
        # Fresh events per iteration, read only after the final sync: reusing events would
        # force a host wait inside the loop.
        marks = [[_timing_event() for _ in range(len(fns) + 1)] for _ in range(iters)]
        # Record on the stream that was current when timing began, even if a fn swaps
        # streams internally.
        stream = torch.cuda.current_stream()
        for events in marks:
            if before_each is not None:
                before_each()
            events[0].record(stream)
            for fn, end in zip(fns, events[1:]):
                fn()
                end.record(stream)

    def samples() -> list[list[float]]:
        marks[-1][-1].synchronize()
        return [_elapsed_us([m[j] for m in marks], [m[j + 1] for m in marks]) for j in range(len(fns))]

    return samples


def _time_with_events(
    fn: Callable[[], object], iters: int, device: torch.device, before_each=None
) -> list[float]:
    """Bracket each call of ``fn`` with CUDA events; one host sync, at the end."""
    samples = _queue_with_events([fn], iters, device, before_each)
    torch.cuda.synchronize(device)
    return samples()[0]


def _host_clock_samples(
    fns: Sequence[Callable[[], object]], iters: int, sync_fn=None, before_each=None
) -> list[list[float]]:
    """Per iteration, ``perf_counter_ns`` before the first of ``fns`` and after each (after
    ``sync_fn``, which runs inside the timed region); per fn, its samples (µs)."""
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(iters):
        if before_each is not None:
            before_each()
        last = time.perf_counter_ns()
        for fn, out in zip(fns, samples):
            fn()
            if sync_fn is not None:
                sync_fn()
            now = time.perf_counter_ns()
            out.append((now - last) / 1e3)
            last = now
    return samples


def _time_with_host_clock(
    fn: Callable[[], object], iters: int, sync_fn=None, before_each=None
) -> list[float]:
    """Time each call of ``fn`` with ``perf_counter_ns``; ``sync_fn`` runs inside the region."""
    return _host_clock_samples([fn], iters, sync_fn, before_each)[0]


def time_fn(
    fn: Callable[[], object],
    *,
    iters: int,
    warmup: int,
    device: torch.device | str | int | None = None,
    sync_fn: Callable[[], object] | None = None,
) -> list[float]:
    """Time ``iters`` calls of ``fn()`` after ``warmup`` untimed calls; microseconds each.

    ``device`` picks the clock: a CUDA device is timed with a start/end event pair per
    iteration on its current stream (the host does not wait inside the loop, apart from
    whatever ``fn`` itself does); any other device with ``time.perf_counter_ns`` around
    each call. ``None`` means CUDA when it is available, else the CPU.

    ``sync_fn`` waits for ``fn``'s asynchronous work. With the host clock it runs after
    every call, inside the timed region, so asynchronous work is counted (e.g.
    ``device="cpu", sync_fn=torch.cuda.synchronize`` times GPU work end to end from the
    host). With CUDA events the events already bound the work, so it runs only after
    warm-up and after the last iteration.

    On a GPU, back-to-back eager iterations still include any launch gaps the host
    leaves; :func:`time_graph_replay` removes them.
    """
    _check_counts(iters, warmup)
    device = _resolve_device(device)
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        if sync_fn is not None:
            sync_fn()
        return _time_with_host_clock(fn, iters, sync_fn)
    # Let warm-up finish so it cannot spill into the first sample.
    torch.cuda.synchronize(device)
    if sync_fn is not None:
        sync_fn()
    samples = _time_with_events(fn, iters, device)
    if sync_fn is not None:
        sync_fn()
    return samples


def capture_graph(fn: Callable[[], object], *, warmup: int = 3) -> torch.cuda.CUDAGraph:
    """Capture one call of ``fn`` in a :class:`torch.cuda.CUDAGraph` and return the graph.

    PyTorch requires the warm-up before capture to run on a side stream: lazy
    initialisation (cuBLAS workspaces, Triton compilation and autotuning, allocator
    growth) must happen outside the graph. At least one warm-up call always runs.
    The tensors ``fn`` reads and writes are baked into the graph: to replay on new data,
    copy it into the same input buffers.
    """
    _require_cuda("capture_graph")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 1)):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as error:
        raise RuntimeError(
            "capturing fn in a CUDA graph failed; host syncs (.item(), .cpu(), "
            ".tolist(), torch.cuda.synchronize()) and CPU-dependent shapes are not "
            f"allowed inside a captured region: {error}"
        ) from error
    return graph


def time_graph_replay(
    fn: Callable[[], object], *, iters: int, warmup: int, replays_per_sample: int = 1
) -> list[float]:
    """Capture ``fn`` in a CUDA graph and time its replays; microseconds per replay.

    ``warmup`` is used twice: eager calls on a side stream before capture (at least one)
    and untimed replays before timing. Each of the ``iters`` samples brackets
    ``replays_per_sample`` back-to-back replays with one event pair and is divided by
    that count: more replays per sample amortise the event resolution (~0.5 µs) for
    graphs of a few microseconds, at the price of averaging within a sample.

    Raises :class:`RuntimeError` without CUDA. To time a graph you captured yourself,
    pass ``graph.replay`` to :func:`time_fn`.
    """
    _check_counts(iters, warmup)
    if not isinstance(replays_per_sample, int) or replays_per_sample < 1:
        raise ValueError(f"replays_per_sample must be an int >= 1, got {replays_per_sample!r}")
    _require_cuda("time_graph_replay")
    graph = capture_graph(fn, warmup=warmup)

    def replay() -> None:
        for _ in range(replays_per_sample):
            graph.replay()

    device = torch.device("cuda", torch.cuda.current_device())
    samples = time_fn(replay, iters=iters, warmup=warmup, device=device)
    return [sample / replays_per_sample for sample in samples]


@dataclass(frozen=True)
class DistributedTimes:
    """Per-iteration times of a multi-rank run, in microseconds.

    ``max_us[i]`` is the slowest rank's time for iteration ``i`` (a collective is only
    done when its last rank is); ``per_rank_us[r][i]`` is rank ``r``'s own time, ranks
    numbered within the group.
    """

    max_us: list[float]
    per_rank_us: list[list[float]]


def _uses_nccl(group) -> bool:
    # A default group made without naming a backend reports e.g. "cpu:gloo,cuda:nccl";
    # if NCCL is in it, the CUDA tensors we time with go through NCCL.
    return "nccl" in str(dist.get_backend(group))


def rank_aligner(group, on_cuda: bool) -> Callable[[], None]:
    """A function that returns on each rank only once every rank has reached it."""
    if not on_cuda:
        return lambda: dist.barrier(group=group)
    token = torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()))

    def align() -> None:
        # The all-reduce completes on this GPU only after every rank has joined it;
        # synchronizing then also drains this rank's queue, so the timed region starts
        # with an idle GPU on every rank at nearly the same moment.
        dist.all_reduce(token, group=group)
        torch.cuda.synchronize()

    return align


def gather_samples(samples: list, group, on_cuda: bool) -> torch.Tensor:
    """All-gather every rank's samples into a CPU float64 tensor [world, ...] (``samples``:
    a list of floats, or of equal-length lists)."""
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else "cpu"
    mine = torch.tensor(samples, dtype=torch.float64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return torch.stack(gathered).cpu()


def time_distributed(
    fn: Callable[[], object], *, iters: int, warmup: int, group=None
) -> DistributedTimes:
    """Time ``fn`` on every rank of ``group``, all ranks starting each iteration together.

    Every rank of the group must call this with the same ``iters`` and ``warmup``.
    Before each iteration (warm-up included) the ranks are aligned: with gloo by
    ``dist.barrier``; with NCCL by a one-element all-reduce followed by
    ``torch.cuda.synchronize()``, on the current CUDA device (set it per rank with
    ``torch.cuda.set_device``). The iteration is then timed on each rank: CUDA events
    with NCCL, ``perf_counter_ns`` with gloo (whose CPU collectives return when done).
    Because the GPU is idle at the start event, a sample includes the host's time to
    launch ``fn``'s kernels, as a real step that starts after a sync would.

    The samples are all-gathered, so every rank returns the same
    :class:`DistributedTimes`.
    """
    _check_counts(iters, warmup)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("time_distributed needs an initialized torch.distributed process group")
    on_cuda = _uses_nccl(group)
    align = rank_aligner(group, on_cuda)
    for _ in range(warmup):
        align()
        fn()
    if on_cuda:
        device = torch.device("cuda", torch.cuda.current_device())
        samples = _time_with_events(fn, iters, device, before_each=align)
    else:
        samples = _time_with_host_clock(fn, iters, before_each=align)
    per_rank = gather_samples(samples, group, on_cuda)
    return DistributedTimes(
        max_us=per_rank.max(dim=0).values.tolist(), per_rank_us=per_rank.tolist()
    )


class PhaseTimer:
    """Time named phases inside an iteration, for per-phase breakdowns.

    ::

        timer = PhaseTimer()
        for _ in range(iters):
            with timer.phase("pack"):
                ...
            with timer.phase("all-to-all"):
                ...
        timer.results()  # {"pack": [µs, ...], "all-to-all": [µs, ...]}

    On CUDA each phase is bracketed by events on the stream that is current when the
    phase opens and closes, and nothing waits until :meth:`results`; elsewhere by
    ``perf_counter_ns`` (``sync_fn``, if given, runs before each clock reading so that
    asynchronous work is attributed to the right phase). A phase entered several times
    contributes one sample per entry. Call :meth:`reset` after warm-up iterations to drop
    their samples. A phase whose body raises records nothing.
    """

    def __init__(
        self,
        device: torch.device | str | int | None = None,
        sync_fn: Callable[[], object] | None = None,
    ) -> None:
        self.device = _resolve_device(device)
        self._sync_fn = sync_fn
        self._marks: dict[str, list[tuple]] = {}

    def _stamp(self):
        if self.device.type == "cuda":
            event = _timing_event()
            with torch.cuda.device(self.device):
                event.record()
            return event
        if self._sync_fn is not None:
            self._sync_fn()
        return time.perf_counter_ns()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = self._stamp()
        yield
        self._marks.setdefault(name, []).append((start, self._stamp()))

    def reset(self) -> None:
        """Forget every recorded phase (e.g. the warm-up iterations')."""
        self._marks.clear()

    def results(self) -> dict[str, list[float]]:
        """Microseconds of every recorded entry of each phase, in first-seen order."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return {
                name: _elapsed_us([s for s, _ in marks], [e for _, e in marks])
                for name, marks in self._marks.items()
            }
        return {
            name: [(end - start) / 1e3 for start, end in marks]
            for name, marks in self._marks.items()
        }


# ----------------------------------------------------------- GPU work only, queued ahead

# torch.cuda._sleep counts GPU clock cycles; 2 cycles per ns is about an H100/H200 under load
# (1.98 GHz). At a lower clock the sleep only lasts longer, which is harmless.
_SLEEP_CYCLES_PER_US = 2000
# Timed iterations per queued sleep. The host can only run as far ahead as the GPU's launch
# queue holds (about a thousand launches); one sleep per chunk renews the head start, so a
# long run never lets the GPU catch up with the host.
QUEUE_CHUNK = 25


def queue_timed(
    fns: Callable[[], object] | Sequence[Callable[[], object]],
    *,
    iters: int,
    warmup: int,
    device: torch.device | str | int | None = None,
    before_each: Callable[[], object] | None = None,
    after_warmup: Callable[[], object] | None = None,
    queue_ahead_us: float = 20.0,
    chunk: int = QUEUE_CHUNK,
) -> Callable[[], list[list[float]]]:
    """Time the GPU work of ``fns`` (one callable or several, called back to back, each timed
    on its own), with the host's launch time kept out of the samples.

    Device work is queued, so an event records when the GPU reaches it; but where the host
    needs longer to launch a call (~10 µs per launch on a slow host) than the GPU needs to
    run it, the GPU waits for the launch between two events and the sample times the host.
    Here the host never waits inside the loop, and before every ``chunk`` timed iterations
    the stream gets a ``torch.cuda._sleep`` of about ``chunk * queue_ahead_us`` µs: the host
    queues the chunk while the GPU sleeps, so the events see the GPU's work only.

    Each of the ``warmup`` untimed and ``iters`` timed iterations runs ``before_each`` first
    (outside the timed region: e.g. an L2 flush, or writing the next inputs into a graph's
    buffers), then the fns with an event before the first and after each. ``after_warmup``
    runs once between the two (e.g. aligning ranks).

    Returns a function that waits for the last iteration and gives, per fn, its µs per
    iteration. Several measurements can be queued back to back this way and read after one
    wait. On the CPU (``device`` "cpu", or None without CUDA) nothing is queued: each fn is
    timed with the host clock, and the function returns the samples already taken.
    """
    _check_counts(iters, warmup)
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
    if not queue_ahead_us >= 0:
        raise ValueError(f"queue_ahead_us must be >= 0, got {queue_ahead_us!r}")
    fns = [fns] if callable(fns) else list(fns)
    if not fns:
        raise ValueError("fns must name at least one callable")
    device = _resolve_device(device)

    def iteration() -> None:
        if before_each is not None:
            before_each()
        for fn in fns:
            fn()

    if device.type != "cuda":
        for _ in range(warmup):
            iteration()
        if after_warmup is not None:
            after_warmup()
        samples = _host_clock_samples(fns, iters, before_each=before_each)
        return lambda: samples
    sleep_cycles = int(chunk * queue_ahead_us * _SLEEP_CYCLES_PER_US)
    can_sleep = sleep_cycles > 0 and hasattr(torch.cuda, "_sleep")
    done = [0]

    def before_timed() -> None:
        if can_sleep and done[0] % chunk == 0:
            torch.cuda._sleep(sleep_cycles)
        done[0] += 1
        if before_each is not None:
            before_each()

    with torch.cuda.device(device):
        for _ in range(warmup):
            iteration()
        if after_warmup is not None:
            after_warmup()
        return _queue_with_events(fns, iters, device, before_each=before_timed)


# ------------------------------------------------------------- GPU work only, cold L2

# A read sweep of this many bytes evicts the L2 of any current GPU (H100 50 MB, H200 60 MB);
# Triton's do_bench uses the same size.
DEFAULT_FLUSH_BYTES = 256 * 2**20


class L2Flusher:
    """Evicts the GPU's L2 cache: ``flusher()`` queues a read of a buffer larger than L2.

    A read, not a write: after a write sweep (``buffer.zero_()``) L2 is full of dirty lines,
    and the next kernel would pay for writing them back to HBM while it runs. After a read
    sweep the lines are clean and eviction costs nothing. The sum lands in a preallocated
    scalar, so a flush allocates nothing (and can be queued between graph replays).
    """

    def __init__(self, nbytes: int = DEFAULT_FLUSH_BYTES, device: torch.device | str | int | None = None):
        if not isinstance(nbytes, int) or nbytes < 4:
            raise ValueError(f"nbytes must be an int >= 4, got {nbytes!r}")
        device = _resolve_device(device)
        if device.type != "cuda":
            raise ValueError(f"L2Flusher needs a CUDA device, got {device}")
        self.nbytes = nbytes
        self.buffer = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
        self._sink = torch.zeros((), dtype=torch.float32, device=device)

    def __call__(self) -> None:
        torch.sum(self.buffer, dim=0, out=self._sink)


def time_cold(
    fn: Callable[[], object],
    *,
    iters: int,
    warmup: int,
    capture: bool = True,
    flush_bytes: int = DEFAULT_FLUSH_BYTES,
    flusher: L2Flusher | None = None,
    queue_ahead_us: float = 20.0,
    device: torch.device | str | int | None = None,
) -> list[float]:
    """Time the GPU work of ``fn`` with a cold L2 and no host launch gaps; µs per call.

    On CUDA, the ``warmup + iters`` iterations are queued by :func:`queue_timed`, each:

    1. an L2 flush (a read sweep of ``flush_bytes``, or ``flusher``; ``flush_bytes=0`` and
       no flusher: none), *outside* the timed region, so data ``fn`` reads (e.g. expert
       weights) comes from HBM as it would in a model whose other layers evicted it;
    2. start event, ``fn`` (with ``capture=True``: one replay of ``fn`` captured once in a CUDA
       graph, so a many-kernel ``fn`` is one launch), end event;

    with a ``torch.cuda._sleep`` of ``queue_ahead_us`` per iteration queued ahead of each
    chunk of iterations, so the host has queued them before the GPU reaches them: the
    samples measure GPU time from the first to the last kernel of ``fn``, not the host's
    ~10 µs per launch. ``fn`` must then be graph-capturable (no host syncs) when ``capture``
    is true; pass an already captured ``graph.replay`` with ``capture=False`` to re-time a
    graph on new data.

    On the CPU (``device`` "cpu", or None without CUDA) there is no cache to flush and no
    queue: each call is timed with the host clock after ``warmup`` calls.
    """
    _check_counts(iters, warmup)
    if not isinstance(flush_bytes, int) or flush_bytes < 0:
        raise ValueError(f"flush_bytes must be an int >= 0, got {flush_bytes!r}")
    if not queue_ahead_us >= 0:
        raise ValueError(f"queue_ahead_us must be >= 0, got {queue_ahead_us!r}")
    device = _resolve_device(device)
    if device.type != "cuda":
        for _ in range(warmup):
            fn()
        return _time_with_host_clock(fn, iters)
    with torch.cuda.device(device):
        run = capture_graph(fn, warmup=1).replay if capture else fn
        if flusher is None and flush_bytes:
            flusher = L2Flusher(flush_bytes, device)
    samples = queue_cold(run, iters=iters, warmup=warmup, flusher=flusher, queue_ahead_us=queue_ahead_us,
                         device=device)
    torch.cuda.synchronize(device)
    return samples()


def queue_cold(
    run: Callable[[], object],
    *,
    iters: int,
    warmup: int,
    flusher: L2Flusher | None = None,
    queue_ahead_us: float = 20.0,
    device: torch.device | str | int | None = None,
) -> Callable[[], list[float]]:
    """:func:`time_cold`'s iterations for ``run`` (called as it is: pass a captured graph's
    ``replay``), queued without waiting for the GPU (:func:`queue_timed` with the flush
    before each iteration).

    Returns a function that waits for the last iteration and gives the samples (µs). Several
    measurements can be queued back to back this way (with other GPU work between them, e.g.
    copying new inputs into the graph's buffers) and read after one wait: the host then never
    stalls the GPU between them. CUDA only.
    """
    _check_counts(iters, warmup)
    _require_cuda("queue_cold")
    samples = queue_timed([run], iters=iters, warmup=warmup, device=device, before_each=flusher,
                          queue_ahead_us=queue_ahead_us)
    return lambda: samples()[0]
