"""End to end: a transformers MoE model generating on moekit against transformers' own experts.

``moekit lm bench --model DIR``: one process, one model. For each implementation —
``transformers`` (the model as loaded: its default experts implementation), then moekit's
``fused`` and ``fused_fp8`` (and ``torch`` if asked) through
:func:`moekit.integrations.transformers.patch` — and each batch size, greedy generation
of ``new_tokens`` tokens from ``prompt_tokens``-token held-out prompts:

* tokens per second: ``batch * new_tokens`` / wall time of ``generate()`` (prefill
  included; the median of ``repeats`` runs after one warm-up run that compiles kernels);
* the MoE blocks' share of that time: CUDA events around every MoE block's forward
  (router, dispatch, experts, combine, shared experts), summed, over the wall time of a
  separate run (so the events do not touch the timed runs);
* token agreement with ``transformers``: the share of generated positions before the
  first difference (greedy decoding follows its own tokens after one), and the share of
  sequences that are identical.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from moekit.integrations.recording import greedy_generate, load_model, prompt_batch, read_prompts

IMPLEMENTATIONS = ("transformers", "torch", "fused", "fused_fp8")


def _generate(model, ids: torch.Tensor, new_tokens: int, pad: int) -> torch.Tensor:
    return greedy_generate(model, ids, new_tokens, pad)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def moe_time_share(model, blocks, run) -> tuple[float, float]:
    """(seconds in MoE blocks, wall seconds) of ``run()``: CUDA events around each block's forward."""
    events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    open_: dict[int, torch.cuda.Event] = {}

    def before(module, args):
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        open_[id(module)] = start

    def after(module, args, output):
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        events.append((open_.pop(id(module)), end))

    hooks = [h for b in blocks for h in (b.register_forward_pre_hook(before), b.register_forward_hook(after))]
    try:
        device = next(model.parameters()).device
        _sync(device)
        t0 = time.perf_counter()
        run()
        _sync(device)
        wall = time.perf_counter() - t0
    finally:
        for h in hooks:
            h.remove()
    return sum(s.elapsed_time(e) for s, e in events) / 1e3, wall


def agreement(got: torch.Tensor, want: torch.Tensor) -> dict:
    """Greedy-token agreement of ``got`` with ``want`` (both ``[B, N]``)."""
    same = (got == want).cpu()
    first_diff = torch.where(same.all(1), same.shape[1], (~same).int().argmax(1))
    return {"prefix_share": float(first_diff.float().mean() / same.shape[1]),
            "identical_sequences": float(same.all(1).float().mean()),
            "position_share": float(same.float().mean())}


def bench_generation(model_dir: str | Path, *, prompts_file: str | Path | None = None, batches=(1, 16, 64),
                     new_tokens: int = 32, prompt_tokens: int = 64, repeats: int = 3,
                     implementations=("transformers", "fused", "fused_fp8"), device: str = "cuda",
                     log=print) -> dict:
    """Run the comparison; returns ``{"params", "rows"}`` (one row per implementation and batch)."""
    from moekit.integrations.transformers import moe_blocks, patch, unpatch

    for impl in implementations:
        if impl not in IMPLEMENTATIONS:
            raise ValueError(f"implementations must be among {IMPLEMENTATIONS}, got {impl!r}")
    if "transformers" not in implementations:
        raise ValueError("implementations must include 'transformers' (the baseline of the token agreement)")
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise ValueError("moekit lm bench times CUDA generation: it needs a GPU (device cuda)")
    model, tokenizer = load_model(model_dir, dev, torch.bfloat16)
    prompts = read_prompts(prompts_file or Path(model_dir) / "heldout_prompts.jsonl")
    ids_all = prompt_batch(tokenizer, prompts, prompt_tokens)
    if ids_all.shape[0] < max(batches):
        raise ValueError(f"{ids_all.shape[0]} prompts of {prompt_tokens} tokens; batch {max(batches)} needs more")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    blocks = [b for _, b in moe_blocks(model)]
    baseline_impl = model.config._experts_implementation
    rows, reference = [], {}
    for impl in implementations:
        if impl != "transformers":
            patch(model, experts=impl)
        try:
            for batch in batches:
                ids = ids_all[:batch].to(dev)
                out = _generate(model, ids, new_tokens, pad)  # warm-up: kernels compile here
                times = []
                for _ in range(repeats):
                    _sync(dev)
                    t0 = time.perf_counter()
                    out = _generate(model, ids, new_tokens, pad)
                    _sync(dev)
                    times.append(time.perf_counter() - t0)
                moe_s, wall = moe_time_share(model, blocks, lambda: _generate(model, ids, new_tokens, pad))
                seconds = statistics.median(times)
                if impl == "transformers":
                    reference[batch] = out
                row = dict(implementation=impl if impl != "transformers" else f"transformers ({baseline_impl})",
                           batch=batch, seconds=seconds, tokens_per_s=batch * new_tokens / seconds,
                           moe_share=moe_s / wall, **agreement(out, reference[batch]))
                rows.append(row)
                log(f"{row['implementation']:>26}  batch {batch:3d}: {row['tokens_per_s']:9.1f} tok/s  "
                    f"MoE {100 * row['moe_share']:5.1f}% of step time  agreement {100 * row['prefix_share']:5.1f}% "
                    f"(identical sequences {100 * row['identical_sequences']:.0f}%)")
        finally:
            if impl != "transformers":
                unpatch(model)
    base = {r["batch"]: r["tokens_per_s"] for r in rows if r["implementation"].startswith("transformers")}
    for r in rows:
        r["speedup_vs_transformers"] = r["tokens_per_s"] / base[r["batch"]]
    params = dict(model_dir=str(model_dir), batches=list(batches), new_tokens=new_tokens, prompt_tokens=prompt_tokens,
                  repeats=repeats, dtype="bfloat16", transformers_experts_implementation=baseline_impl,
                  device_name=torch.cuda.get_device_name(dev), num_moe_blocks=len(blocks))
    return {"params": params, "rows": rows}
