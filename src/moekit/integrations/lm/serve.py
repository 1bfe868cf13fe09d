"""Serving a transformers MoE model on several GPUs: moekit's expert parallelism against
transformers' own multi-GPU options, in one run on the same GPUs (``moekit lm serve-bench``).

The models are presets at their real dimensions and depth (:mod:`.presets`), with random weights
drawn per tensor and per expert (:mod:`.seeded`), so every implementation runs the same model
and nothing is downloaded. One process per GPU (``moekit.ep.launch`` starts them, or
``torchrun``); every process runs every implementation in turn, and rank 0 writes the record.

Implementations (``--implementations``):

* ``moekit-ep``: :func:`~moekit.integrations.lm.build_expert_parallel` -- each rank holds the
  attention and shared weights and its own ``E / P`` experts, serves its own batch (data-parallel
  attention), and the MoE blocks move tokens with the all-to-all dispatcher; one unit per
  ``--experts`` kind (``fused``: bf16 fused kernel, ``fused_fp8``: W8A8 FP8 experts, ``torch``).
* ``moekit-1gpu``: the whole model on rank 0's GPU, patched with the same experts (where it fits).
* ``transformers-tp``: ``from_pretrained(..., distributed_config=DistributedConfig(tp_size=P,
  tp_plan="auto"))``, transformers' tensor parallelism
  (every weight sharded, the experts by their hidden dimension; all ranks run the same batch).
* ``transformers-ep``: ``from_pretrained(..., distributed_config=DistributedConfig(tp_size=P,
  enable_expert_parallel=True))``, transformers' expert parallelism (the model's
  ``base_model_ep_plan``: experts sharded by expert; all ranks run the same batch).
* ``transformers-device-map``: ``from_pretrained(..., device_map="auto")`` on rank 0, the layers
  split over the GPUs and run one after another.
* ``transformers-1gpu``: the model on rank 0's GPU with transformers' own experts.

transformers reads its options from a checkpoint folder: rank 0 writes the same weights there
once (safetensors, one file per layer; reused by later runs) before the first transformers
option. An option the installed transformers does not have is recorded as unsupported.

Batches are per GPU: ``batch`` sequences on each rank for moekit's expert parallelism, ``batch *
P`` sequences for the options that run one batch over P GPUs, ``batch`` on one GPU. Each row
(per model, implementation, mode and batch) measures greedy generation of ``new_tokens`` tokens
after ``prompt_tokens``-token prompts:

* ``tokens_per_s``: decode tokens per second per GPU (sequences per GPU * (new_tokens - 1) / (time
  of the whole generation - time to first token); medians of ``repeats`` runs after a warm-up);
* ``ttft_s``: time to first token (the prefill), ``peak_mem_gib``: the largest peak of allocated
  GPU memory over the GPUs the row used;
* token agreement with the single-GPU run of the same prompts (the first single-GPU unit to run;
  named in ``agreement_reference``): rank 0's first ``batch`` sequences against it;
* ``vs_best_transformers``: ``tokens_per_s`` over the best transformers option's at the same GPU
  count, model, phase, mode and batch.

Prefill rows (``phase="prefill"``): ``prefill_batch`` sequences per GPU of ``prefill_tokens``
tokens, eager; ``tokens_per_s`` is prompt tokens per second per GPU and ``ttft_s`` the prefill time.

Modes: ``eager`` (dynamic cache) and ``compiled`` (static cache and ``torch.compile`` of the
decoding forward: ``fullgraph=True, mode="reduce-overhead"`` -- CUDA graphs -- for every option
except moekit's expert parallelism, whose all-to-all reads the message sizes on the host once
per MoE block: it compiles with ``fullgraph=False`` in the default mode).

Rows that run out of memory, or whose option is unsupported or fails, are recorded with
``status`` and ``error`` instead of stopping the run (all ranks agree on a row's status). The
record is rewritten after every implementation, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

IMPLEMENTATIONS = ("moekit-ep", "moekit-1gpu", "transformers-tp", "transformers-ep", "transformers-device-map",
                   "transformers-1gpu")
MULTI_GPU = ("moekit-ep", "transformers-tp", "transformers-ep", "transformers-device-map")
EXPERT_LABELS = {"fused": "bf16", "fused_fp8": "fp8", "torch": "torch experts"}
MODES = ("eager", "compiled")
GRAPH_COMPILE = dict(fullgraph=True, mode="reduce-overhead")
EP_COMPILE = dict(fullgraph=False, mode="default")


@dataclass
class ServeSpec:
    """What one run measures (the CLI's options)."""

    models: tuple[str, ...] = ("olmoe-1b-7b", "qwen3-30b-a3b")
    layers: int | None = None  # None: each model's real depth
    batches: tuple[int, ...] = (1, 16, 64, 256)
    model_batches: dict = field(default_factory=dict)  # model -> batches, overriding ``batches``
    implementations: tuple[str, ...] = IMPLEMENTATIONS
    experts: tuple[str, ...] = ("fused", "fused_fp8")
    modes: tuple[str, ...] = ("eager", "compiled")
    compiled_batches: tuple[int, ...] | None = None  # None: every batch
    new_tokens: int = 16
    prompt_tokens: int = 64
    prefill_tokens: int = 2048
    prefill_batch: int = 1  # 0: no prefill rows
    repeats: int = 2
    seed: int = 0
    checkpoint_dir: str = "/tmp/moekit-serve-checkpoints"
    out_dir: str = "moekit-results"
    record_name: str = ""
    device: str = "cuda"
    smoke: bool = False

    def batches_of(self, model: str) -> tuple[int, ...]:
        return tuple(self.model_batches.get(model, self.batches))


@dataclass
class Unit:
    """One implementation (with one experts kind for moekit's) of one model: loaded once, then timed."""

    impl: str
    experts: str | None
    label: str
    gpus: int
    inputs: str  # "per-rank": each rank its own batch; "replicated": one batch of batch * P on every rank; "rank0"

    @property
    def single(self) -> bool:
        return self.inputs == "rank0"


def plan_units(spec: ServeSpec, world_size: int) -> list[Unit]:
    """The units of one model, single-GPU first (the first one gives the agreement reference)."""
    units = []
    for impl in ("moekit-1gpu", "transformers-1gpu", "moekit-ep", "transformers-tp", "transformers-ep",
                 "transformers-device-map"):
        if impl not in spec.implementations or (impl in MULTI_GPU and world_size < 2):
            continue
        if impl in ("moekit-1gpu", "moekit-ep"):
            where = "1 GPU" if impl == "moekit-1gpu" else f"EP {world_size} GPUs"
            for kind in spec.experts:
                units.append(Unit(impl, kind, f"moekit {where} {EXPERT_LABELS[kind]}",
                                  1 if impl == "moekit-1gpu" else world_size,
                                  "rank0" if impl == "moekit-1gpu" else "per-rank"))
            continue
        label = {"transformers-1gpu": "transformers 1 GPU", "transformers-tp": f"transformers TP {world_size} GPUs",
                 "transformers-ep": f"transformers EP {world_size} GPUs",
                 "transformers-device-map": f"transformers device_map {world_size} GPUs"}[impl]
        single = impl in ("transformers-1gpu", "transformers-device-map")
        units.append(Unit(impl, None, label, 1 if impl == "transformers-1gpu" else world_size,
                          "rank0" if single else "replicated"))
    return units


# ----------------------------------------------------------------------------- ranks


class _Ranks:
    """This process's rank, its device, and what the ranks agree on."""

    def __init__(self, device: str):
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        if device == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self.cuda = self.device.type == "cuda"

    def gather(self, value) -> list:
        if self.world == 1:
            return [value]
        out = [None] * self.world
        dist.all_gather_object(out, value)
        return out

    def first_error(self, error: str | None) -> str | None:
        """Every rank's error for this step, the first one (rank order), or None: all ranks decide alike."""
        return next((e for e in self.gather(error) if e), None)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def _free(rk: _Ranks) -> None:
    gc.collect()
    torch._dynamo.reset()
    if rk.cuda:
        torch.cuda.empty_cache()


def _classify(exc: BaseException) -> tuple[str, str]:
    text = f"{type(exc).__name__}: {exc}".splitlines()[0][:400]
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text.lower():
        return "oom", text
    unsupported = ("not supported", "pip install", "requires", "unsupported")
    if isinstance(exc, (NotImplementedError, TypeError, ImportError, AttributeError)) or any(
            word in text.lower() for word in unsupported):
        return "unsupported", text
    return "error", text


# ----------------------------------------------------------------------------- checkpoints


def checkpoint_path(spec: ServeSpec, model: str, layers: int, dtype: torch.dtype) -> Path:
    return Path(spec.checkpoint_dir) / f"{model}-L{layers}-seed{spec.seed}-{str(dtype).split('.')[-1]}"


def write_checkpoint(path: Path, model: str, layers: int, *, seed: int, dtype, device, log=print) -> Path:
    """The seeded model as a transformers checkpoint folder (config.json, one safetensors file per
    decoder layer, the index), written one tensor at a time; kept when complete (``COMPLETE``)."""
    from safetensors.torch import save_file

    from moekit.integrations.lm.seeded import iter_checkpoint_tensors, resolve_config

    if (path / "COMPLETE").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    config = resolve_config(model, layers)
    config.dtype = dtype  # what from_pretrained(..., dtype="auto") would pick
    config.save_pretrained(path)
    weight_map: dict[str, str] = {}
    pending: dict[str, torch.Tensor] = {}
    group = None
    total = 0

    def flush():
        nonlocal pending
        if pending:
            name = f"model-{len(set(weight_map.values())):05d}.safetensors"
            save_file(pending, str(path / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(pending, name))
            pending = {}

    for name, tensor in iter_checkpoint_tensors(model, layers=layers, dtype=dtype, device=device, seed=seed):
        parts = name.split(".")
        key = parts[2] if len(parts) > 2 and parts[1] == "layers" else "rest"
        if key != group:
            flush()
            group = key
        pending[name] = tensor.to("cpu").contiguous()
        total += tensor.numel() * tensor.element_size()
    flush()
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (path / "COMPLETE").write_text("ok\n")
    log(f"checkpoint {path} ({total / 2**30:.1f} GiB) written in {time.perf_counter() - t0:.0f} s")
    return path


# ----------------------------------------------------------------------------- loading


def _load_unit(unit: Unit, spec: ServeSpec, model_name: str, layers: int, dtype, rk: _Ranks, ckpt: Path | None):
    from moekit.integrations.lm.parallel import build_expert_parallel
    from moekit.integrations.lm.seeded import seeded_model
    from moekit.integrations.transformers import patch

    if unit.impl == "moekit-ep":
        return build_expert_parallel(model_name, layers=layers, experts=unit.experts, dtype=dtype, device=rk.device,
                                     seed=spec.seed)
    if unit.impl in ("moekit-1gpu", "transformers-1gpu"):
        model = seeded_model(model_name, layers=layers, dtype=dtype, device=rk.device, seed=spec.seed)
        if unit.impl == "moekit-1gpu":
            from moekit.ep.local import LocalDispatcher
            from moekit.integrations.transformers import _top_k, moe_blocks

            block = moe_blocks(model)[0][1]
            local = LocalDispatcher(int(block.experts.gate_up_proj.shape[0]), hidden=int(block.experts.gate_up_proj.shape[2]),
                                    top_k=_top_k(block))
            patch(model, experts=unit.experts, dispatcher=local)
        return model
    if isinstance(ckpt, Exception):
        raise ckpt  # the checkpoint could not be written: every option reading it fails alike
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    common = dict(dtype=dtype, local_files_only=True)
    if unit.impl == "transformers-tp":
        try:
            config = _distributed_config(tp_size=rk.world, tp_plan="auto")
        except NotImplementedError:  # a transformers from before DistributedConfig took the plan
            model = AutoModelForCausalLM.from_pretrained(ckpt, tp_plan="auto", **common)
        else:
            model = AutoModelForCausalLM.from_pretrained(ckpt, distributed_config=config, **common)
    elif unit.impl == "transformers-ep":
        config = _distributed_config(tp_size=rk.world, enable_expert_parallel=True)
        model = AutoModelForCausalLM.from_pretrained(ckpt, distributed_config=config, **common)
    elif unit.impl == "transformers-device-map":
        if not rk.cuda:
            raise NotImplementedError("device_map splitting needs GPUs")
        free = {i: int(torch.cuda.mem_get_info(i)[0] * 0.85) for i in range(rk.world)}
        model = AutoModelForCausalLM.from_pretrained(ckpt, device_map="auto", max_memory=free, **common)
    else:
        raise ValueError(f"unknown implementation {unit.impl!r}")
    return model.eval()


def _distributed_config(**fields):
    """transformers' ``DistributedConfig(**fields)``; NotImplementedError where this transformers
    has no such config or not these fields (the row then says so)."""
    try:
        from transformers.distributed import DistributedConfig
    except ImportError as exc:
        raise NotImplementedError(f"this transformers has no DistributedConfig: {exc}") from None
    import dataclasses

    known = {f.name for f in dataclasses.fields(DistributedConfig)}
    missing = sorted(set(fields) - known)
    if missing:
        raise NotImplementedError(f"DistributedConfig has no {missing} here (fields: {sorted(known)})")
    return DistributedConfig(**fields)


# ----------------------------------------------------------------------------- timing


def _generate(model, ids, new_tokens: int, pad: int, mode: str, compile_options: dict) -> torch.Tensor:
    from moekit.integrations.lm.parallel import generate_tokens

    return generate_tokens(model, ids, new_tokens, pad_token_id=pad, compiled=mode == "compiled",
                           compile_options=compile_options)


def _forget_compiled(model) -> None:
    model.__dict__.pop("_compiled_call", None)
    model.__dict__.pop("_last_compile_config", None)
    torch._dynamo.reset()


def _peak_gib(rk: _Ranks, unit: Unit) -> float | None:
    if not rk.cuda:
        return None
    if unit.impl == "transformers-device-map":
        return max(torch.cuda.max_memory_allocated(i) for i in range(rk.world)) / 2**30
    return torch.cuda.max_memory_allocated(rk.device) / 2**30


def _reset_peak(rk: _Ranks, unit: Unit) -> None:
    if rk.cuda:
        for i in (range(rk.world) if unit.impl == "transformers-device-map" else [rk.device.index]):
            torch.cuda.reset_peak_memory_stats(i)


def _kv_bytes(config, seqs: int, tokens: int, dtype) -> int:
    """The KV cache of ``seqs`` sequences of ``tokens`` tokens (every layer holds all of it)."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * seqs * tokens * torch.finfo(dtype).bits // 8


def _parameter_counts(config) -> tuple[int, int]:
    """(all parameters, routed-expert parameters) of the model of ``config``, counted on the meta device."""
    from moekit.integrations.lm.seeded import causal_lm_class, experts_modules

    with torch.device("meta"):
        model = causal_lm_class(config)(config)
    experts = sum(p.numel() for _, m in experts_modules(model) for p in m.parameters())
    return sum(p.numel() for p in model.parameters()), experts


def agreement(got: torch.Tensor, want: torch.Tensor) -> dict:
    """Greedy-token agreement of ``got`` with ``want`` (both ``[B, N]``)."""
    same = (got.cpu() == want.cpu())
    first_diff = torch.where(same.all(1), same.shape[1], (~same).int().argmax(1))
    return {"prefix_share": float(first_diff.float().mean() / same.shape[1]),
            "identical_sequences": float(same.all(1).float().mean()),
            "position_share": float(same.float().mean())}


class _Bench:
    def __init__(self, spec: ServeSpec, rk: _Ranks, log):
        self.spec, self.rk, self.log = spec, rk, log
        self.rows: list[dict] = []
        self.t0 = time.perf_counter()
        self.dtype = torch.bfloat16 if rk.cuda else torch.float32

    def say(self, text: str) -> None:
        if self.rk.rank == 0:
            self.log(f"[{time.perf_counter() - self.t0:7.1f} s] {text}")

    # one row ------------------------------------------------------------------------------
    def row(self, model, unit: Unit, base: dict, ids: torch.Tensor, new_tokens: int, mode: str, pad: int,
            reference: dict, ref_key, need_bytes: int) -> dict:
        rk, spec = self.rk, self.spec
        compile_options = EP_COMPILE if unit.impl == "moekit-ep" else GRAPH_COMPILE
        row = dict(base, mode=mode, compile=None if mode == "eager" else compile_options, status="ok", error=None,
                   tokens_per_s=None, ttft_s=None, generate_s=None, peak_mem_gib=None)
        error = None
        if rk.cuda and unit.impl != "transformers-device-map":
            free = torch.cuda.mem_get_info(rk.device)[0]
            if need_bytes > 0.9 * free:
                error = (f"oom (predicted): the KV cache and activations need {need_bytes / 2**30:.1f} GiB, "
                         f"{free / 2**30:.1f} GiB free")
        if not unit.single:
            error = rk.first_error(error)
        if error:
            row.update(status="oom", error=error)
            return row
        try:
            _reset_peak(rk, unit)
            run = lambda n: _generate(model, ids, n, pad, mode, compile_options)  # noqa: E731
            out = run(new_tokens)  # warm-up (and compilation)
            prefill, full = [], []
            for _ in range(spec.repeats):
                rk.sync(); t = time.perf_counter(); run(1); rk.sync(); prefill.append(time.perf_counter() - t)
                rk.sync(); t = time.perf_counter(); out = run(new_tokens); rk.sync(); full.append(time.perf_counter() - t)
            times = (statistics.median(prefill), statistics.median(full), _peak_gib(rk, unit))
            error = None
        except Exception as exc:  # a row that fails is recorded, the run goes on
            error = "|".join(_classify(exc))
            times, out = None, None
            if rk.cuda:
                torch.cuda.empty_cache()
        if not unit.single:
            gathered = rk.gather((error, times))
            error = next((e for e, _ in gathered if e), None)
            if not error:
                times = (max(t[0] for _, t in gathered), max(t[1] for _, t in gathered),
                         None if times[2] is None else max(t[2] for _, t in gathered))
        if error:
            status, text = error.split("|", 1)
            row.update(status=status, error=text)
            return row
        ttft, whole, peak = times
        seqs_per_gpu = base["batch"]
        decode = max(whole - ttft, 1e-9)
        row.update(ttft_s=ttft, generate_s=whole, peak_mem_gib=peak,
                   tokens_per_s=seqs_per_gpu * (new_tokens - 1) / decode if new_tokens > 1 else None)
        if rk.rank == 0:
            mine = out[: base["batch"]]
            this = f"{unit.label} ({mode})"
            if ref_key not in reference:  # the first run of these prompts is the reference of the later ones
                reference[ref_key] = (this, mine)
            elif reference[ref_key][0] != this:
                row.update(agreement(mine, reference[ref_key][1]), agreement_reference=reference[ref_key][0])
        return row

    def prefill_row(self, model, unit, base, ids, pad, reference, ref_key, need_bytes) -> dict:
        row = self.row(model, unit, base, ids, 1, "eager", pad, reference, ref_key, need_bytes)
        if row["status"] == "ok" and row["ttft_s"]:
            row["tokens_per_s"] = base["batch"] * ids.shape[1] / row["ttft_s"]
        return row

    # one unit -----------------------------------------------------------------------------
    def unit(self, unit: Unit, model_name: str, layers: int, config, prompts, prefill_prompts, reference: dict,
             ckpt: Path | None, write) -> None:
        rk, spec = self.rk, self.spec
        base = dict(implementation=unit.label, impl=unit.impl, experts=unit.experts, model=model_name, layers=layers,
                    gpus=unit.gpus, inputs=unit.inputs, dtype=str(self.dtype).split(".")[-1])
        if unit.single and rk.rank != 0:
            rk.barrier()  # rank 0 runs it alone; the others wait here
            return
        model, error = None, None
        try:
            if rk.cuda:
                _reset_peak(rk, unit)
                error = self._fits(unit, config)
            if error is None:
                t = time.perf_counter()
                model = _load_unit(unit, spec, model_name, layers, self.dtype, rk, ckpt)
                self.say(f"{model_name}: {unit.label} loaded in {time.perf_counter() - t:.1f} s")
        except Exception as exc:
            error = _classify(exc)
            _free(rk)
        if not unit.single:
            first = rk.first_error(None if error is None else f"{error[0]}|{error[1]}")
            error = None if first is None else tuple(first.split("|", 1))
        batches = spec.batches_of(model_name)
        if error:
            status, text = error
            for mode in spec.modes:
                for b in batches:
                    self.rows.append(dict(base, phase="decode", mode=mode, batch=b, total_batch=self._total(unit, b),
                                          status=status, error=text, tokens_per_s=None))
            self.say(f"{model_name}: {unit.label}: {status}: {text}")
        else:
            pad = config.pad_token_id or 0
            for mode in spec.modes:
                chosen = [b for b in batches if mode == "eager" or spec.compiled_batches is None
                          or b in spec.compiled_batches]
                for b in chosen:
                    ids = self._ids(unit, prompts, b)
                    total = self._total(unit, b)
                    on_gpu = total if unit.inputs == "replicated" or unit.single else b
                    need = self._need(config, on_gpu, prompts.shape[1] + spec.new_tokens, unit)
                    r = self.row(model, unit, dict(base, phase="decode", batch=b, total_batch=total), ids,
                                 spec.new_tokens, mode, pad, reference, ("decode", b), need)
                    self._report(r)
                    if mode == "compiled" and model is not None:
                        _forget_compiled(model)
            if spec.prefill_batch and prefill_prompts is not None:
                b = spec.prefill_batch
                ids = self._ids(unit, prefill_prompts, b)
                total = self._total(unit, b)
                need = self._need(config, total if unit.inputs != "per-rank" else b, prefill_prompts.shape[1] + 1,
                                  unit, prefill=True)
                r = self.prefill_row(model, unit, dict(base, phase="prefill", batch=b, total_batch=total), ids, pad,
                                     reference, ("prefill", b), need)
                self._report(r)
        del model
        _free(rk)
        if unit.single:
            rk.barrier()
        write()

    def _fits(self, unit: Unit, config) -> tuple[str, str] | None:
        """("oom", why) when one GPU's share of the weights cannot fit in its free memory (checked
        before building, which at real size takes a while), else None."""
        weights, experts = _parameter_counts(config)
        per_gpu = {"moekit-ep": weights - experts + experts / self.rk.world, "transformers-tp": weights / self.rk.world,
                   "transformers-ep": weights - experts + experts / self.rk.world,
                   "transformers-device-map": weights / self.rk.world}.get(unit.impl, weights)
        need = per_gpu * torch.finfo(self.dtype).bits / 8
        if unit.experts == "fused_fp8":  # the W8A8 kernel's e4m3 copy of the experts (one byte each) beside them
            need += experts / (self.rk.world if unit.impl == "moekit-ep" else 1)
        free = torch.cuda.mem_get_info(self.rk.device)[0]
        if need > 0.95 * free:
            return "oom", f"oom (predicted): the weights need {need / 2**30:.1f} GiB per GPU, {free / 2**30:.1f} GiB free"
        return None

    def _report(self, r: dict) -> None:
        self.rows.append(r)
        what = f"{r['model']} {r['phase']:>7} {r['mode']:>8} {r['implementation']:>30} batch {r['batch']:3d}"
        if r["status"] != "ok":
            self.say(f"{what}: {r['status']}: {r['error']}")
            return
        agree = f"  agreement {100 * r['prefix_share']:5.1f}%" if r.get("prefix_share") is not None else ""
        mem = f"  peak {r['peak_mem_gib']:.1f} GiB" if r.get("peak_mem_gib") is not None else ""
        tps = f"{r['tokens_per_s']:10.1f} tok/s/GPU" if r.get("tokens_per_s") else " " * 20
        self.say(f"{what}: {tps}  ttft {1e3 * r['ttft_s']:8.1f} ms{mem}{agree}")

    def _total(self, unit: Unit, b: int) -> int:
        return b if unit.impl in ("moekit-1gpu", "transformers-1gpu") else b * self.rk.world

    def _ids(self, unit: Unit, prompts: torch.Tensor, b: int) -> torch.Tensor:
        rk = self.rk
        if unit.inputs == "per-rank":
            ids = prompts[rk.rank * b:(rk.rank + 1) * b]
        else:
            ids = prompts[: self._total(unit, b)]
        dev = rk.device if unit.impl != "transformers-device-map" else torch.device("cuda", 0)
        return ids.to(dev)

    def _need(self, config, seqs: int, tokens: int, unit: Unit, prefill: bool = False) -> int:
        """A lower bound of the memory a row adds on one GPU: the KV cache (split over the GPUs by
        tensor parallelism's heads) and, for a prefill, the MoE block's dispatched rows."""
        kv = _kv_bytes(config, seqs, tokens, self.dtype)
        if unit.impl == "transformers-tp":
            kv //= self.rk.world
        if prefill:
            k = getattr(config, "num_experts_per_tok", 1)
            kv += 4 * seqs * tokens * k * config.hidden_size * 2
        return kv


def run_rank(rank: int, world_size: int, spec_dict: dict) -> list[dict]:
    """One rank of the serve benchmark (``moekit.ep.launch`` target); rank 0 writes the record."""
    spec = ServeSpec(**spec_dict)
    spec.models, spec.batches = tuple(spec.models), tuple(spec.batches)
    torch.manual_seed(spec.seed)
    rk = _Ranks(spec.device)
    _torchrun_environment(rk)
    bench = _Bench(spec, rk, print)
    params = _params(spec, rk)
    record = {}

    def write():
        if rk.rank == 0:
            results = {"rows": _with_ratios(bench.rows), "complete": False}
            record["path"] = _write(spec, params, results, rk)

    for model_name in spec.models:
        from moekit.integrations.lm.presets import REAL_LAYERS, preset_config, random_prompts

        layers = spec.layers or REAL_LAYERS.get(model_name, 2)
        config = preset_config(model_name, layers=layers)
        batches = spec.batches_of(model_name)
        prompts = random_prompts(config.vocab_size, max(batches) * rk.world, spec.prompt_tokens, seed=spec.seed)
        prefill = None
        if spec.prefill_batch:
            prefill = random_prompts(config.vocab_size, spec.prefill_batch * rk.world, spec.prefill_tokens,
                                     seed=spec.seed + 1)
        units = plan_units(spec, rk.world)
        bench.say(f"{model_name}: {layers} layers, {rk.world} rank(s) on {rk.device.type}; units: "
                  + ", ".join(u.label for u in units))
        reference: dict = {}
        ckpt = None
        for unit in units:
            if ckpt is None and unit.impl in ("transformers-tp", "transformers-ep", "transformers-device-map"):
                # After moekit's units: writing it takes a while at real size.
                path, error = _checkpoint(spec, model_name, layers, bench, rk)
                ckpt = RuntimeError(error) if error else path
            bench.unit(unit, model_name, layers, config, prompts, prefill, reference, ckpt, write)
    if rk.rank == 0:
        results = {"rows": _with_ratios(bench.rows), "complete": True}
        record["path"] = _write(spec, params, results, rk)
        bench.say(f"record: {record['path']}")
    return _with_ratios(bench.rows) if rk.rank == 0 else []


def _checkpoint(spec: ServeSpec, model_name: str, layers: int, bench: _Bench, rk: _Ranks) -> tuple[Path, str | None]:
    """(the transformers options' checkpoint, every rank's view of the error writing it or None),
    written by rank 0 (once: a complete one is reused)."""
    ckpt = checkpoint_path(spec, model_name, layers, bench.dtype)
    error = None
    if rk.rank == 0:
        try:
            write_checkpoint(ckpt, model_name, layers, seed=spec.seed, dtype=bench.dtype, device=rk.device,
                             log=bench.say)
        except Exception as exc:
            error = f"checkpoint {ckpt}: {type(exc).__name__}: {exc}"
    return ckpt, rk.first_error(error)


def _torchrun_environment(rk: _Ranks) -> None:
    """transformers' parallel loaders read the rank from torchrun's variables (``LOCAL_RANK`` picks
    the GPU): ranks started on GPUs by ``moekit.ep.launch`` set them as torchrun would, one host."""
    import os

    if rk.world == 1 or not rk.cuda:
        return  # nothing to pick (the CPU loaders read the process group), and a process that later
        # launches ranks must not look like torchrun's
    for name, value in (("RANK", rk.rank), ("LOCAL_RANK", rk.rank), ("WORLD_SIZE", rk.world),
                        ("LOCAL_WORLD_SIZE", rk.world)):
        os.environ.setdefault(name, str(value))


def _with_ratios(rows: list[dict]) -> list[dict]:
    """``vs_best_transformers`` on every row: its tokens/s over the best transformers option's at the
    same model, phase, mode, GPU count and batch (None where there is none)."""
    best: dict = {}
    for r in rows:
        if r["impl"].startswith("transformers") and r.get("tokens_per_s"):
            key = (r["model"], r["phase"], r["mode"], r["gpus"], r["batch"])
            if r["tokens_per_s"] > best.get(key, (0.0, None))[0]:
                best[key] = (r["tokens_per_s"], r["implementation"])
    out = []
    for r in rows:
        b = best.get((r["model"], r["phase"], r["mode"], r["gpus"], r["batch"]))
        ratio = r["tokens_per_s"] / b[0] if b and r.get("tokens_per_s") else None
        out.append(dict(r, vs_best_transformers=ratio, best_transformers=b[1] if b else None))
    return out


def _params(spec: ServeSpec, rk: _Ranks) -> dict:
    import transformers

    params = asdict(spec)
    params.update(world_size=rk.world, device_type=rk.device.type, transformers=transformers.__version__,
                  backend=dist.get_backend() if dist.is_initialized() else None,
                  compile_settings={"moekit-ep": EP_COMPILE, "others": GRAPH_COMPILE},
                  note=("CPU smoke run at toy size (tiny presets, gloo): checks the code path, "
                        "its numbers say nothing about GPU serving") if spec.smoke else None)
    if rk.cuda:
        params["device_name"] = torch.cuda.get_device_name(rk.device)
    return params


def record_folder(spec: ServeSpec, world_size: int, cuda: bool) -> Path:
    from moekit.bench.report import _slug

    device = _slug(torch.cuda.get_device_name(0)) if cuda else "cpu"
    return Path(spec.out_dir) / f"lm-serve-{device}-{world_size}x"


def _write(spec: ServeSpec, params: dict, results: dict, rk: _Ranks) -> Path:
    from moekit.bench.report import write_record

    return write_record("lm-serve", params, results, out_dir=record_folder(spec, rk.world, rk.cuda),
                        name=spec.record_name)


def serve_bench(spec: ServeSpec, gpus: int, *, timeout: float = 1800.0) -> list[dict]:
    """Run the benchmark on ``gpus`` ranks (spawned here, or this process's rank under torchrun);
    returns rank 0's rows (empty on the other ranks under torchrun)."""
    from moekit.ep import launch

    if not spec.record_name:
        spec.record_name = "lm-serve-" + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + ".json"
    backend = "nccl" if spec.device == "cuda" else "gloo"
    results = launch(run_rank, gpus, asdict(spec), backend=backend, timeout=timeout)
    return results[0]


def _ints(name: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{name} must be comma-separated ints, got {text!r}") from None
    if not values or any(not 1 <= v <= 4096 for v in values):
        raise ValueError(f"{name} must be ints in [1, 4096], got {text!r}")
    return values


def _names(name: str, text: str, allowed) -> tuple[str, ...]:
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    bad = [v for v in values if v not in allowed]
    if not values or bad:
        raise ValueError(f"{name} must be comma-separated among {', '.join(allowed)}, got {text!r}")
    return values


def serve_args_to_spec(args) -> tuple[ServeSpec, int]:
    """(spec, ranks to start) from the ``moekit lm serve-bench`` options, checked before any work."""
    import os

    from moekit.integrations.lm.presets import MODEL_PRESETS
    from moekit.outputs import check_output_dir

    smoke = args.cpu or not torch.cuda.is_available()
    check_output_dir(args.out_dir, "--out-dir")
    models = _names("--models", args.models or ("tiny-olmoe,tiny-qwen3" if smoke else "olmoe-1b-7b,qwen3-30b-a3b"),
                    MODEL_PRESETS)
    model_batches = {}
    for part in (args.model_batches or "").split(";"):
        if part.strip():
            model, _, batches = part.partition("=")
            if model.strip() not in models:
                raise ValueError(f"--model-batches names {model.strip()!r}, which is not among --models {models}")
            model_batches[model.strip()] = _ints("--model-batches", batches)
    experts = _names("--experts", args.experts or ("torch" if smoke else "fused,fused_fp8"), EXPERT_LABELS)
    if smoke and set(experts) - {"torch"}:
        raise ValueError("--experts: the fused kernels need a GPU; a CPU run takes --experts torch")
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if under_torchrun:
        gpus = int(os.environ["WORLD_SIZE"])
    elif args.gpus is not None:
        gpus = args.gpus
    else:
        gpus = 2 if smoke else max(torch.cuda.device_count(), 1)
    if not smoke and not under_torchrun and gpus > torch.cuda.device_count():
        raise ValueError(f"--gpus {gpus}: only {torch.cuda.device_count()} GPUs are visible")
    if gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {gpus}")
    for name in ("new_tokens", "prompt_tokens", "prefill_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.prefill_batch < 0:
        raise ValueError(f"--prefill-batch must be >= 0, got {args.prefill_batch}")
    spec = ServeSpec(models=models, layers=args.layers, batches=_ints("--batches", args.batches),
                     model_batches=model_batches,
                     implementations=_names("--implementations", args.implementations, IMPLEMENTATIONS),
                     experts=experts, modes=_names("--modes", args.modes or ("eager" if smoke else "eager,compiled"),
                                                   MODES),
                     compiled_batches=None if args.compiled_batches is None else _ints("--compiled-batches",
                                                                                        args.compiled_batches),
                     new_tokens=args.new_tokens, prompt_tokens=args.prompt_tokens, prefill_tokens=args.prefill_tokens,
                     prefill_batch=args.prefill_batch, repeats=args.repeats, seed=args.seed,
                     checkpoint_dir=args.checkpoint_dir, out_dir=args.out_dir,
                     device="cpu" if smoke else "cuda", smoke=smoke)
    return spec, gpus
