"""How much an exchange on the side stream slows the compute beside it (the SM budget's price).

An NCCL collective runs as thread blocks on SMs the compute kernels beside it would
otherwise use; ``--comm-sms`` caps them (:func:`moekit.dice.stale.exchange_group`). This
probe times, on every rank, with CUDA events:

* ``compute_ms``: a fixed chain of matrix products (the expert MLP's shape at this
  model's width) alone on the compute stream;
* ``exchange_ms``: one stale dispatch exchange of a step's rows alone on the side stream;
* both started together (the side stream waits for an event on the compute stream, then
  each runs its own work): ``compute_beside_ms`` and ``exchange_beside_ms``.

``compute_slowdown`` = compute_beside / compute and ``exchange_slowdown`` likewise: what
the budget costs the compute and what it costs the exchange. Medians over ``iters``
repetitions, each after a device synchronize (every rank runs the same sequence, so the
collectives pair up).
"""

from __future__ import annotations

import statistics

import torch


def probe(exchange, hidden: int, rows: int, dtype: torch.dtype, device: torch.device, *, iters: int = 10,
          products: int = 24, seed: int = 0) -> dict:
    """The figures of the module docstring for ``exchange`` (a StaleExchange) at ``rows`` rows."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g, device=device, dtype=torch.float32).to(dtype)
    ids = torch.randint(0, exchange.num_experts, (rows, 1), generator=g, device=device)
    w = torch.ones(rows, 1, dtype=torch.float32, device=device)
    a = torch.randn(max(rows, 1024), hidden, generator=g, device=device, dtype=torch.float32).to(dtype)
    b = torch.randn(hidden, hidden, generator=g, device=device, dtype=torch.float32).to(dtype) / hidden ** 0.5
    side = torch.cuda.Stream(device)
    main = torch.cuda.current_stream(device)

    def compute():
        y = a
        for _ in range(products):
            y = y @ b
        return y

    def exchange_once():
        return exchange.issue(x, ids, w)

    def timed(on_main: bool, on_side: bool) -> tuple[float | None, float | None]:
        torch.cuda.synchronize(device)
        start = torch.cuda.Event(enable_timing=True)
        end_main, end_side = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(main)
        if on_side:
            with torch.cuda.stream(side):
                side.wait_event(start)
                exchange_once()
                end_side.record(side)
        if on_main:
            compute()
            end_main.record(main)
        torch.cuda.synchronize(device)
        return (start.elapsed_time(end_main) if on_main else None,
                start.elapsed_time(end_side) if on_side else None)

    for _ in range(2):  # warm-up: kernels, the communicator
        timed(True, True)
    alone_c = [timed(True, False)[0] for _ in range(iters)]
    alone_x = [timed(False, True)[1] for _ in range(iters)]
    both = [timed(True, True) for _ in range(iters)]
    compute_ms, exchange_ms = statistics.median(alone_c), statistics.median(alone_x)
    compute_beside = statistics.median(c for c, _ in both)
    exchange_beside = statistics.median(x for _, x in both)
    return dict(rows=rows, compute_ms=compute_ms, exchange_ms=exchange_ms, compute_beside_ms=compute_beside,
                exchange_beside_ms=exchange_beside, compute_slowdown=compute_beside / compute_ms,
                exchange_slowdown=exchange_beside / exchange_ms)


__all__ = ["probe"]
