"""End to end: a transformers MoE model generating on moekit against transformers' own experts.

``moekit lm bench``: one process, one model -- a saved one (``--model DIR``, e.g. from ``moekit
lm train``) or one of :mod:`moekit.integrations.lm.presets` at real dimensions, randomly
initialized (``--preset qwen3-30b-a3b --layers 4``). For each mode (``eager``: transformers'
dynamic cache, no compilation; ``compiled``: a static cache and ``torch.compile(fullgraph=True,
mode="reduce-overhead")`` of the decoding forward, i.e. CUDA graphs, the same settings for every
implementation), each implementation -- ``transformers`` (the model as loaded: its default
experts implementation), then moekit's ``fused`` and ``fused_fp8`` (and ``torch``) through
:func:`moekit.integrations.transformers.patch`, optionally with a kernel-config policy
(``fused:auto`` is ``patch(model, experts="fused", kernel_config="auto")``) -- and each batch
size, greedy generation of ``new_tokens`` tokens from ``prompt_tokens``-token prompts:

* tokens per second: ``batch * new_tokens`` / wall time of ``generate()`` (prefill
  included; the median of ``repeats`` runs after one warm-up run that compiles kernels and, in
  the compiled mode, the graphs);
* the MoE blocks' share of that time (eager mode): CUDA events around every MoE block's forward
  (router, dispatch, experts, combine, shared experts), summed, over the wall time of a
  separate run (so the events do not touch the timed runs);
* token agreement with ``transformers`` in the same mode: the share of generated positions
  before the first difference (greedy decoding follows its own tokens after one), and the
  share of sequences that are identical.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from moekit.integrations.recording import greedy_generate, load_model, prompt_batch, read_prompts

IMPLEMENTATIONS = ("transformers", "torch", "fused", "fused_fp8")
MODES = ("eager", "compiled")


def parse_implementation(spec: str) -> tuple[str, str | None]:
    """``"fused"`` -> ("fused", None); ``"fused:auto"`` -> ("fused", "auto") (experts, kernel-config policy)."""
    experts, _, policy = spec.partition(":")
    if experts not in IMPLEMENTATIONS:
        raise ValueError(f"implementations must be among {IMPLEMENTATIONS} (optionally 'fused:POLICY'), got {spec!r}")
    if policy:
        from moekit.ops.policy import POLICIES

        if experts in ("transformers", "torch") or policy not in POLICIES:
            raise ValueError(f"a kernel-config policy ({', '.join(POLICIES)}) goes with fused or fused_fp8, "
                             f"got {spec!r}")
    return experts, policy or None


def _generate(model, ids: torch.Tensor, new_tokens: int, pad: int, mode: str) -> torch.Tensor:
    if mode == "eager":
        return greedy_generate(model, ids, new_tokens, pad)
    from transformers import CompileConfig

    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad,
                             cache_implementation="static",
                             compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
    return out[:, ids.shape[1]:]


def _forget_compiled(model) -> None:
    """Drop what one implementation's compiled runs left (graphs, the compiled call), so the
    next implementation is compiled afresh under the same settings."""
    model.__dict__.pop("_compiled_call", None)
    model.__dict__.pop("_last_compile_config", None)
    torch._dynamo.reset()


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


def _load(model_dir, preset, layers, dev, prompts_file, prompt_tokens, max_batch):
    """(model, name, [B, prompt_tokens] prompt ids, pad id, layer count)."""
    if (model_dir is None) == (preset is None):
        raise ValueError("give either a model folder (--model) or a model preset (--preset)")
    if preset is not None:
        from moekit.integrations.lm.presets import random_model, random_prompts

        model = random_model(preset, layers=layers, dtype=torch.bfloat16, device=dev)
        ids = random_prompts(model.config.vocab_size, max_batch, prompt_tokens, device="cpu")
        return model, preset, ids, model.config.pad_token_id or 0, model.config.num_hidden_layers
    model, tokenizer = load_model(model_dir, dev, torch.bfloat16)
    prompts = read_prompts(prompts_file or Path(model_dir) / "heldout_prompts.jsonl")
    ids = prompt_batch(tokenizer, prompts, prompt_tokens)
    if ids.shape[0] < max_batch:
        raise ValueError(f"{ids.shape[0]} prompts of {prompt_tokens} tokens; batch {max_batch} needs more")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return model, Path(model_dir).name, ids, pad, model.config.num_hidden_layers


def bench_generation(model_dir: str | Path | None = None, *, preset: str | None = None, layers: int | None = 4,
                     prompts_file: str | Path | None = None, batches=(1, 16, 64), new_tokens: int = 32,
                     prompt_tokens: int = 64, repeats: int = 3,
                     implementations=("transformers", "fused", "fused_fp8"), modes=("eager",),
                     device: str = "cuda", log=print) -> dict:
    """Run the comparison; returns ``{"params", "rows"}`` (one row per mode, implementation and batch)."""
    from moekit.integrations.transformers import moe_blocks, patch, unpatch

    if "transformers" not in implementations:
        raise ValueError("implementations must include 'transformers' (the baseline of the ratios and the agreement)")
    implementations = ["transformers"] + [spec for spec in implementations if spec != "transformers"]
    specs = [parse_implementation(spec) for spec in implementations]
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"modes must be among {MODES}, got {mode!r}")
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise ValueError("moekit lm bench times CUDA generation: it needs a GPU (device cuda)")
    model, name, ids_all, pad, num_layers = _load(model_dir, preset, layers, dev, prompts_file, prompt_tokens,
                                                  max(batches))
    blocks = [b for _, b in moe_blocks(model)]
    baseline_impl = model.config._experts_implementation
    rows = []

    def measure(mode: str, spec: str, experts: str, batch: int, reference: dict) -> None:
        label = f"transformers ({baseline_impl})" if experts == "transformers" else f"moekit {spec}"
        try:
            timed(mode, spec, experts, batch, reference, label)
        except torch.OutOfMemoryError as exc:  # a row that does not fit is reported, not fatal
            torch.cuda.empty_cache()
            rows.append(dict(implementation=label, model=name, layers=num_layers, mode=mode, batch=batch,
                             seconds=None, tokens_per_s=None, moe_share=None, error="out of memory: "
                             + str(exc).split(".")[0]))
            log(f"{mode:>8} {label:>26}  batch {batch:3d}: out of GPU memory")

    def timed(mode: str, spec: str, experts: str, batch: int, reference: dict, label: str) -> None:
        ids = ids_all[:batch].to(dev)
        run = lambda: _generate(model, ids, new_tokens, pad, mode)  # noqa: E731
        out = run()  # warm-up: kernels (and graphs) compile here
        times = []
        for _ in range(repeats):
            _sync(dev)
            t0 = time.perf_counter()
            out = run()
            _sync(dev)
            times.append(time.perf_counter() - t0)
        moe_share = None
        if mode == "eager":
            moe_s, wall = moe_time_share(model, blocks, run)
            moe_share = moe_s / wall
        seconds = statistics.median(times)
        if experts == "transformers":
            reference[batch] = out
        agree = agreement(out, reference[batch]) if batch in reference else {}
        row = dict(implementation=label, model=name, layers=num_layers, mode=mode, batch=batch, seconds=seconds,
                   tokens_per_s=batch * new_tokens / seconds, moe_share=moe_share, **agree)
        rows.append(row)
        share = "" if moe_share is None else f"  MoE {100 * moe_share:5.1f}% of step time"
        log(f"{mode:>8} {label:>26}  batch {batch:3d}: {row['tokens_per_s']:9.1f} tok/s{share}  "
            + (f"agreement {100 * row['prefix_share']:5.1f}% (identical sequences "
               f"{100 * row['identical_sequences']:.0f}%)" if "prefix_share" in row else "(transformers: no row)"))

    def patched(experts: str, policy):
        if experts != "transformers":
            patch(model, experts=experts, kernel_config=policy)

    def unpatched(experts: str, mode: str):
        if experts != "transformers":
            unpatch(model)
        if mode == "compiled":
            _forget_compiled(model)

    for mode in modes:
        reference: dict = {}
        if mode == "eager":
            # Implementations interleaved per batch size, so a drift of the host's speed during the
            # run (these rows are host-bound at small batches) touches every implementation alike.
            for batch in batches:
                for spec, (experts, policy) in zip(implementations, specs):
                    patched(experts, policy)
                    try:
                        measure(mode, spec, experts, batch, reference)
                    finally:
                        unpatched(experts, mode)
            continue
        for spec, (experts, policy) in zip(implementations, specs):  # one compilation per implementation
            patched(experts, policy)
            try:
                for batch in batches:
                    measure(mode, spec, experts, batch, reference)
            finally:
                unpatched(experts, mode)
    base = {(r["mode"], r["batch"]): r["tokens_per_s"] for r in rows if r["implementation"].startswith("transformers")}
    for r in rows:
        b = base.get((r["mode"], r["batch"]))
        r["speedup_vs_transformers"] = r["tokens_per_s"] / b if r["tokens_per_s"] and b else None
    params = dict(model=name, model_dir=None if model_dir is None else str(model_dir), preset=preset,
                  layers=num_layers, batches=list(batches), new_tokens=new_tokens, prompt_tokens=prompt_tokens,
                  repeats=repeats, modes=list(modes), implementations=list(implementations), dtype="bfloat16",
                  transformers_experts_implementation=baseline_impl, device_name=torch.cuda.get_device_name(dev),
                  num_moe_blocks=len(blocks),
                  compiled_settings="static cache, torch.compile(fullgraph=True, mode='reduce-overhead')")
    return {"params": params, "rows": rows}
