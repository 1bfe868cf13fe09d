"""Train a small OLMoE-architecture MoE language model on the standard library's source.

The recipe (``moekit lm train``; :data:`PRESETS` holds the sizes):

1. corpus: :func:`moekit.integrations.lm.corpus.split` (fixed file order, named files held out);
2. tokenizer: byte-level BPE trained on the training files only;
3. data: each split tokenized into one stream (files separated by ``<|endoftext|>``);
   training batches are windows at seeded random offsets; the held-out loss is the mean
   next-token cross-entropy on evenly spaced windows of the held-out stream (the same
   windows at every evaluation);
4. model: ``transformers.OlmoeForCausalLM`` from an ``OlmoeConfig`` (softmax top-k router,
   load-balancing auxiliary loss as OLMoE trains it), AdamW with linear warm-up and cosine
   decay, gradient clipping at 1. On a GPU the model computes in bfloat16 while the
   optimizer keeps float32 master weights; on the CPU everything is float32;
5. length: ``steps`` if given, else as many steps as fit in ``minutes`` at the rate measured
   over the first steps (the planned count is printed and recorded, so a run can be
   repeated with ``--steps``);
6. output: ``model.safetensors`` + ``config.json``, the tokenizer files (``AutoTokenizer``
   loads them), ``train.json`` (recipe, corpus fingerprint, losses, timing, versions) and
   ``heldout_prompts.jsonl`` (held-out text for ``moekit trace record``).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from . import corpus as corpus_mod
from .tokenizer import END_OF_TEXT, as_transformers, encode_files, train_tokenizer


@dataclass(frozen=True)
class LMConfig:
    """Sizes and schedule of a training run (see :data:`PRESETS`)."""

    layers: int = 8
    hidden: int = 512
    heads: int = 8
    experts: int = 64
    top_k: int = 8
    expert_intermediate: int = 256  # N, the width of one expert
    vocab_size: int = 8192
    seq_len: int = 512
    batch_size: int = 64  # sequences per step
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    aux_loss_coef: float = 0.01  # OLMoE's load-balancing loss weight
    steps: int | None = None  # None: as many as fit in `minutes`
    minutes: float = 5.0
    max_steps: int = 20000
    eval_windows: int = 128
    holdout_every: int = 50
    max_corpus_bytes: int | None = None  # read at most this much of each split (tiny runs)
    seed: int = 0
    log_every: int = 25
    prompts: int = 256  # held-out prompts written for trace recording
    prompt_tokens: int = 160

    def check(self) -> "LMConfig":
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("steps", "max_corpus_bytes") and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{f.name} must be a non-negative number, got {value!r}")
        positive = ("layers", "hidden", "heads", "experts", "top_k", "expert_intermediate", "seq_len",
                    "batch_size", "eval_windows", "max_steps", "log_every", "minutes", "lr")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.hidden % self.heads:
            raise ValueError(f"heads={self.heads} must divide hidden={self.hidden}")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k must be in [1, experts={self.experts}], got {self.top_k}")
        if self.steps is not None and (isinstance(self.steps, bool) or not isinstance(self.steps, int)
                                       or self.steps < 1):
            raise ValueError(f"steps must be an int >= 1 or None, got {self.steps!r}")
        return self


PRESETS = {
    # 8 layers x 64 experts, top-8 (OLMoE's E and K), ~210M parameters of which ~40M active
    # per token; sized to learn routing in ~5 minutes on one H100.
    "default": LMConfig(),
    # Seconds on a CPU: for tests and a first look.
    "tiny": LMConfig(layers=2, hidden=64, heads=4, experts=8, top_k=2, expert_intermediate=32, vocab_size=400,
                     seq_len=64, batch_size=4, steps=4, warmup_steps=2, eval_windows=4, max_corpus_bytes=200_000,
                     log_every=1, prompts=8, prompt_tokens=48),
}


def model_config(cfg: LMConfig, vocab_size: int, eot: int):
    """The ``transformers.OlmoeConfig`` of the recipe."""
    from transformers import OlmoeConfig

    return OlmoeConfig(vocab_size=vocab_size, hidden_size=cfg.hidden, intermediate_size=cfg.expert_intermediate,
                       num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads,
                       num_experts=cfg.experts, num_experts_per_tok=cfg.top_k, norm_topk_prob=False,
                       max_position_embeddings=cfg.seq_len, router_aux_loss_coef=cfg.aux_loss_coef,
                       output_router_logits=False, tie_word_embeddings=False, pad_token_id=eot,
                       eos_token_id=eot, bos_token_id=None)


def lr_at(step: int, total: int, cfg: LMConfig) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr`` at ``total``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class _MixedPrecisionAdamW:
    """AdamW on float32 master copies of a low-precision model (or on the model itself in float32)."""

    def __init__(self, model: torch.nn.Module, cfg: LMConfig, fused: bool):
        self.params = [p for p in model.parameters() if p.requires_grad]
        low = self.params[0].dtype != torch.float32
        self.masters = [p.detach().float().clone() for p in self.params] if low else self.params
        decay = [m for p, m in zip(self.params, self.masters) if p.dim() >= 2]
        no_decay = [m for p, m in zip(self.params, self.masters) if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)

    def step(self, lr: float) -> torch.Tensor:
        """One update at learning rate ``lr``; returns the gradient norm before clipping (on the device)."""
        if self.masters is not self.params:
            for p, m in zip(self.params, self.masters):
                m.grad = None if p.grad is None else p.grad.float()
        norm = torch.nn.utils.clip_grad_norm_(self.masters, 1.0)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.masters is not self.params:
            with torch.no_grad():
                for p, m in zip(self.params, self.masters):
                    p.copy_(m)
                    p.grad = None
        return norm


def _windows(stream: np.ndarray, starts: np.ndarray, length: int, device) -> torch.Tensor:
    idx = starts[:, None] + np.arange(length)[None, :]
    return torch.from_numpy(stream[idx].astype(np.int64)).to(device, non_blocking=True)


def eval_starts(n_tokens: int, seq_len: int, count: int) -> np.ndarray:
    """``count`` evenly spaced window starts over a stream of ``n_tokens`` (fewer if it is short)."""
    last = n_tokens - seq_len
    if last < 0:
        raise ValueError(f"the held-out stream has {n_tokens} tokens, fewer than seq_len={seq_len}")
    count = min(count, last // seq_len + 1)
    return np.linspace(0, last, count).astype(np.int64)


@torch.no_grad()
def held_out_loss(model, stream: np.ndarray, starts: np.ndarray, seq_len: int, batch_size: int, device) -> float:
    """Mean next-token cross-entropy (nats) over the windows at ``starts`` (no auxiliary loss)."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(starts), batch_size):
        x = _windows(stream, starts[i:i + batch_size], seq_len, device)
        logits = model(input_ids=x, output_router_logits=False).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                 reduction="sum")
        total += float(loss)
        count += x[:, 1:].numel()
    model.train()
    return total / count


def _pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available")
    return dev


def _experts_implementation(model, want: str, probe: Callable[[], None], log) -> str:
    """Set transformers' experts implementation; ``auto`` tries grouped_mm and falls back to eager."""
    choices = ("auto", "grouped_mm", "batched_mm", "eager")
    if want not in choices:
        raise ValueError(f"experts_impl must be one of {choices}, got {want!r}")
    for name in (("grouped_mm", "eager") if want == "auto" else (want,)):
        model.config._experts_implementation = name
        try:
            probe()
            return name
        except (RuntimeError, NotImplementedError) as err:
            if want != "auto":
                raise
            log(f"experts implementation {name} failed its probe step ({str(err).splitlines()[0][:120]}); "
                "trying eager")
            model.zero_grad(set_to_none=True)
    raise RuntimeError("no experts implementation ran")  # unreachable: eager always runs


def train(cfg: LMConfig, out_dir: str | Path, *, device: str = "auto", experts_impl: str = "auto",
          corpus_root: str | Path | None = None, log: Callable[[str], None] = print) -> dict:
    """Run the recipe; write the model, tokenizer and records to ``out_dir``; return the record."""
    import transformers
    from transformers import OlmoeForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    cfg = cfg.check()
    dev = _pick_device(device)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    train_files, held_files = corpus_mod.split(corpus_root, cfg.holdout_every)
    corpus_info = corpus_mod.describe(train_files, held_files)
    log(f"corpus: {corpus_info['train_files']} training files ({corpus_info['train_bytes'] / 1e6:.1f} MB), "
        f"{corpus_info['held_out_files']} held out ({corpus_info['held_out_bytes'] / 1e6:.2f} MB), "
        f"Python {corpus_info['python']}")

    tok = train_tokenizer(train_files.texts(cfg.max_corpus_bytes), cfg.vocab_size)
    eot = tok.token_to_id(END_OF_TEXT)
    as_transformers(tok).save_pretrained(out)
    train_stream = encode_files(tok, train_files.texts(cfg.max_corpus_bytes))
    held_stream = encode_files(tok, held_files.texts(cfg.max_corpus_bytes))
    log(f"tokenizer: byte-level BPE, {tok.get_vocab_size()} tokens; {len(train_stream):,} training tokens, "
        f"{len(held_stream):,} held-out tokens ({time.perf_counter() - t_start:.1f} s so far)")
    if len(train_stream) <= cfg.seq_len + 1:
        raise ValueError(f"the training stream has {len(train_stream)} tokens; seq_len={cfg.seq_len} needs more")
    starts_eval = eval_starts(len(held_stream), cfg.seq_len, cfg.eval_windows)

    torch.manual_seed(cfg.seed)
    model = OlmoeForCausalLM(model_config(cfg, tok.get_vocab_size(), eot)).to(dev)
    if dev.type == "cuda":
        model.to(torch.bfloat16)  # computes in bf16; the optimizer keeps float32 masters
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = n_params - expert_params + expert_params * cfg.top_k // cfg.experts
    log(f"model: OlmoeForCausalLM {cfg.layers} layers, H={cfg.hidden}, {cfg.experts} experts top-{cfg.top_k} "
        f"(N={cfg.expert_intermediate}); {n_params / 1e6:.1f}M parameters, {active / 1e6:.1f}M active per token; "
        f"device {dev}{' ' + torch.cuda.get_device_name(dev) if dev.type == 'cuda' else ''}")
    # Masters are taken from the model after the cast: float32 -> bf16 -> float32 keeps the bf16
    # values, so masters and model start equal.
    optimizer = _MixedPrecisionAdamW(model, cfg, fused=dev.type == "cuda")
    rng = np.random.default_rng(cfg.seed)
    high = len(train_stream) - cfg.seq_len

    def batch() -> torch.Tensor:
        return _windows(train_stream, rng.integers(0, high, cfg.batch_size), cfg.seq_len, dev)

    def loss_of(x: torch.Tensor):
        out_ = model(input_ids=x, labels=x, output_router_logits=True)
        return out_.loss, out_.aux_loss

    def probe() -> None:
        loss, _ = loss_of(_windows(train_stream, np.zeros(min(2, cfg.batch_size), dtype=np.int64), cfg.seq_len, dev))
        loss.backward()
        model.zero_grad(set_to_none=True)

    impl = _experts_implementation(model, experts_impl, probe, log)
    initial_loss = held_out_loss(model, held_stream, starts_eval, cfg.seq_len, cfg.batch_size, dev)
    log(f"experts implementation: {impl}; held-out loss before training {initial_loss:.3f} nats/token")

    total = cfg.steps or cfg.max_steps
    planned_by_time = cfg.steps is None
    calib = (5, 25)  # steps timed to plan a time-budgeted run (after warm-up of kernels)
    budget = cfg.minutes * 60.0
    history, ema = [], None
    t_train = time.perf_counter()
    t_calib = None
    step = 0
    while step < total:
        x = batch()
        loss, aux = loss_of(x)
        loss.backward()
        lr = lr_at(step, total, cfg)
        grad_norm = optimizer.step(lr)
        step += 1
        if dev.type == "cuda" and step in calib:
            torch.cuda.synchronize(dev)
        if planned_by_time and step == calib[0]:
            t_calib = time.perf_counter()
        if planned_by_time and step == calib[1]:
            per_step = (time.perf_counter() - t_calib) / (calib[1] - calib[0])
            left = budget - (time.perf_counter() - t_train)
            total = max(step + 1, min(cfg.max_steps, step + int(left / per_step)))
            log(f"planned {total} steps: {per_step * 1e3:.0f} ms per step, {cfg.minutes:g} min budget")
        if step % cfg.log_every == 0 or step == total:
            value = float(loss.detach())
            aux_value = float(aux.detach()) if aux is not None else float("nan")
            ema = value if ema is None else 0.9 * ema + 0.1 * value
            elapsed = time.perf_counter() - t_train
            tokens = step * cfg.batch_size * cfg.seq_len
            history.append(dict(step=step, loss=value, aux_loss=aux_value, lr=lr,
                                grad_norm=float(grad_norm), elapsed_s=elapsed))
            log(f"step {step:5d}/{total}  loss {value:.3f} (ema {ema:.3f})  aux {aux_value:.3f}  lr {lr:.2e}  "
                f"{tokens / elapsed:,.0f} tok/s  {elapsed:.0f} s")
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    train_s = time.perf_counter() - t_train
    final_loss = held_out_loss(model, held_stream, starts_eval, cfg.seq_len, cfg.batch_size, dev)
    log(f"held-out loss {final_loss:.3f} nats/token ({final_loss / math.log(2):.3f} bits) after {step} steps, "
        f"{step * cfg.batch_size * cfg.seq_len / 1e6:.1f}M tokens, {train_s:.0f} s of training")

    model.config.output_router_logits = False
    model.save_pretrained(out, safe_serialization=True)
    prompts = _write_prompts(out / "heldout_prompts.jsonl", tok, held_stream, cfg, eot)
    record = dict(
        recipe="moekit.integrations.lm.train", config=asdict(cfg), device=str(dev),
        device_name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        dtype="bfloat16 compute, float32 master weights" if dev.type == "cuda" else "float32",
        experts_implementation=impl, corpus=corpus_info, vocab_size=tok.get_vocab_size(),
        train_tokens=int(len(train_stream)), held_out_tokens=int(len(held_stream)), eval_windows=int(len(starts_eval)),
        parameters=n_params, active_parameters=active, steps=step, planned_by_time=planned_by_time,
        tokens_seen=step * cfg.batch_size * cfg.seq_len, train_seconds=train_s,
        total_seconds=time.perf_counter() - t_start, held_out_loss_initial=initial_loss,
        held_out_loss=final_loss, history=history, prompts_written=prompts,
        versions=dict(torch=torch.__version__, transformers=transformers.__version__),
    )
    (out / "train.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    log(f"saved model, tokenizer, train.json and {prompts} held-out prompts to {out}")
    return record


def _write_prompts(path: Path, tok, stream: np.ndarray, cfg: LMConfig, eot: int) -> int:
    """Held-out text for trace recording: evenly spaced windows that do not cross a file boundary."""
    n = cfg.prompt_tokens
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        for start in np.linspace(0, max(0, len(stream) - n), 4 * cfg.prompts).astype(np.int64):
            piece = stream[start:start + n]
            if len(piece) < n or (piece == eot).any():
                continue
            f.write(json.dumps({"text": tok.decode(piece.tolist())}) + "\n")
            written += 1
            if written == cfg.prompts:
                break
    return written


def config_with(preset: str, **overrides) -> LMConfig:
    """A preset with some fields replaced (None values are left as the preset has them)."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    return replace(PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None}).check()
