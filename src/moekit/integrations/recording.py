"""Routing traces of a transformers MoE model, recorded through the moekit integration.

:func:`record_traces` runs greedy generation over batches of prompts with the model's MoE
blocks on moekit (:func:`moekit.integrations.transformers.patch`) and a
:class:`moekit.routing.RoutingRecorder` on their routing taps. Every forward pass is one
step: the prefill of a batch (``batch_size * prompt_tokens`` tokens) and then one step per
generated token (``batch_size`` tokens). The two phases go to two traces, because their
token counts differ by ``prompt_tokens`` times and per-peer statistics split a step's rows
over ranks:

* prefill: ``[batches, layers, batch_size * prompt_tokens, K]``;
* decode: ``[batches * decode_steps, layers, batch_size, K]``;

token rows padded with ``-1`` to a multiple of ``pad_multiple`` (the world size the
statistics will use). Prompts are cut to the same length, so a batch needs no padding and
every row is a real token.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from moekit.routing import RoutingRecorder, RoutingTrace


def load_model(model_dir: str | Path, device="cpu", dtype=None):
    """A saved causal LM (eval mode) and its tokenizer from a local folder; nothing is downloaded.

    ``dtype`` None: bfloat16 on a GPU, float32 on the CPU.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the loader's bars would fill a log; it reads local files only
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"model {model_dir}: not a saved transformers model folder (no config.json)")
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer


def read_prompts(path: str | Path) -> list[str]:
    """Prompts from a file: ``.jsonl`` (a JSON string or an object with "text" per line), else one per line."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"prompts file {path} does not exist")
    prompts = []
    with open(p, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            if p.suffix != ".jsonl":
                prompts.append(line.rstrip("\n"))
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not JSON ({err.msg})") from None
            text = item.get("text") if isinstance(item, dict) else item
            if not isinstance(text, str):
                raise ValueError(f"{path}:{number}: expected a string or an object with a string 'text'")
            prompts.append(text)
    if not prompts:
        raise ValueError(f"prompts file {path} holds no prompt")
    return prompts


def prompt_batch(tokenizer, prompts: list[str], length: int) -> torch.Tensor:
    """The prompts at least ``length`` tokens long, each cut to its first ``length`` tokens: ``[n, length]``."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"prompt_tokens must be an int >= 1, got {length!r}")
    rows = [ids[:length] for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"] if len(ids) >= length]
    if not rows:
        raise ValueError(f"no prompt has {length} tokens; use fewer prompt tokens or longer prompts")
    return torch.tensor(rows, dtype=torch.long)


def greedy_generate(model, ids: torch.Tensor, new_tokens: int, pad_token_id: int) -> torch.Tensor:
    """``new_tokens`` greedy tokens after ``ids`` (exactly that many: no early stop)."""
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_token_id)
    return out[:, ids.shape[1]:]


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def record_traces(model, tokenizer, prompts: list[str], *, batch_size: int = 8, prompt_tokens: int = 128,
                  decode_steps: int = 32, max_batches: int | None = None, experts: str = "torch",
                  pad_multiple: int = 8, weights: bool = False, name: str = "",
                  metadata: dict | None = None, log=print) -> tuple[RoutingTrace, RoutingTrace | None]:
    """(prefill trace, decode trace or None when ``decode_steps`` is 0) of ``model`` on ``prompts``.

    The model is patched with ``experts`` for the recording and unpatched afterwards (a
    model already patched is used as it is). Prompts shorter than ``prompt_tokens`` are
    skipped; a last partial batch is dropped so every step has the same shape. Ids are
    stored as int16; ``weights=True`` keeps the routing weights too (float32, larger files).
    """
    from moekit.integrations.transformers import is_patched, num_routed_experts, patch, routing_taps, unpatch

    _check_int("batch_size", batch_size, 1)
    _check_int("decode_steps", decode_steps, 0)
    _check_int("pad_multiple", pad_multiple, 1)
    if batch_size % pad_multiple:
        log(f"note: batch_size={batch_size} is not a multiple of {pad_multiple}: decode steps have padding rows, "
            "and per-peer statistics on that many ranks give the last ranks fewer tokens")
    ids = prompt_batch(tokenizer, prompts, prompt_tokens)
    n_batches = ids.shape[0] // batch_size
    if max_batches is not None:
        n_batches = min(n_batches, _check_int("max_batches", max_batches, 1))
    if n_batches == 0:
        raise ValueError(f"{ids.shape[0]} prompts have {prompt_tokens} tokens; batch_size={batch_size} needs more")
    E = num_routed_experts(model)
    if E > np.iinfo(np.int16).max:
        raise ValueError(f"num_experts={E} does not fit the int16 ids of the recorded trace")
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    patched_here = not is_patched(model)
    if patched_here:
        patch(model, experts=experts)
    prefill, decode = [], []
    try:
        taps = routing_taps(model)
        for b in range(n_batches):
            rec = RoutingRecorder(taps)
            with rec:
                # decode_steps + 1 new tokens = one prefill pass and decode_steps decode passes
                greedy_generate(model, ids[b * batch_size:(b + 1) * batch_size].to(device), decode_steps + 1, pad)
            trace = rec.to_trace(E, pad_multiple=pad_multiple)
            if trace.num_steps != decode_steps + 1:
                raise RuntimeError(f"expected {decode_steps + 1} forward passes per batch, recorded {trace.num_steps}")
            prefill.append(trace.topk_ids[:1].astype(np.int16))
            decode.append(trace.topk_ids[1:, :, :_round_up(batch_size, pad_multiple)].astype(np.int16))
            if weights:
                prefill[-1] = (prefill[-1], trace.topk_weights[:1])
                decode[-1] = (decode[-1], trace.topk_weights[1:, :, :_round_up(batch_size, pad_multiple)])
            if (b + 1) % max(1, n_batches // 8) == 0 or b + 1 == n_batches:
                log(f"recorded batch {b + 1}/{n_batches} ({batch_size} prompts x {prompt_tokens} tokens, "
                    f"{decode_steps} decode steps)")
    finally:
        if patched_here:
            unpatch(model)
    meta = dict(metadata or {}, batch_size=batch_size, prompt_tokens=prompt_tokens, decode_steps=decode_steps,
                batches=n_batches, pad_multiple=pad_multiple, experts=experts, decoding="greedy",
                layers="MoE blocks in model order")
    prefill_trace = _assemble(prefill, weights, E, f"{name} prefill".strip(),
                              dict(meta, phase="prefill", tokens_per_step=batch_size * prompt_tokens))
    decode_trace = None
    if decode_steps:
        decode_trace = _assemble(decode, weights, E, f"{name} decode".strip(),
                                 dict(meta, phase="decode", tokens_per_step=batch_size))
    return prefill_trace, decode_trace


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _assemble(parts, weights: bool, num_experts: int, name: str, metadata: dict) -> RoutingTrace:
    if weights:
        ids = np.concatenate([p[0] for p in parts])
        w = np.concatenate([p[1] for p in parts])
    else:
        ids, w = np.concatenate(parts), None
    return RoutingTrace(topk_ids=ids, num_experts=num_experts, topk_weights=w, name=name, metadata=metadata)
