"""Train a small class-conditional DiT-MoE on the bundled 8 x 8 digits (rectified flow).

The recipe's model is :func:`moekit.dice.dit_moe.digits_config` (2 x 2 patches: 16 tokens
per image) with the release's MoE (8 SwiGLU experts, top-2, a shared expert, the balance
loss). AdamW, constant learning rate after a short linear warm-up, an exponential moving
average of the weights for sampling (as DiT does), stopping after ``steps`` or
``time_budget_s`` seconds, whichever comes first. Sizes and times are all in
:class:`TrainConfig`; the CPU defaults train for seconds, a GPU run uses a few minutes.

Checkpoints are ``torch.save`` of plain tensors and numbers, read back with
``weights_only=True`` (no code runs when loading).
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from moekit.dice.dit_moe import DiTMoE, DiTMoEConfig, digits_config
from moekit.dice.quality import Digits
from moekit.dice.sampler import rf_loss


@dataclass
class TrainConfig:
    hidden: int = 32
    depth: int = 2
    num_heads: int = 2
    num_experts: int = 8
    top_k: int = 2
    steps: int = 20
    batch: int = 64
    lr: float = 1e-3
    warmup_steps: int = 10
    ema_decay: float = 0.999
    time_budget_s: float | None = None
    seed: int = 0
    log_every: int = 10

    def __post_init__(self) -> None:
        for name in ("hidden", "depth", "num_heads", "num_experts", "top_k", "steps", "batch", "log_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1), got {self.ema_decay}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            raise ValueError(f"time_budget_s must be > 0 or None, got {self.time_budget_s}")

    def model_config(self) -> DiTMoEConfig:
        return digits_config(hidden=self.hidden, depth=self.depth, num_heads=self.num_heads,
                             num_experts=self.num_experts, top_k=self.top_k)


def train_dit(cfg: TrainConfig, data: Digits, *, device: torch.device | str = "cpu",
              progress=print) -> tuple[DiTMoE, list[dict]]:
    """Train on ``data.train_x``; returns the EMA model (eval mode) and the loss log."""
    device = torch.device(device)
    torch.manual_seed(cfg.seed)
    model = DiTMoE(cfg.model_config(), seed=cfg.seed).to(device)
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    x_all, y_all = data.train_x.to(device), data.train_y.to(device)
    g = torch.Generator(device=device).manual_seed(cfg.seed)
    log: list[dict] = []
    start = time.perf_counter()
    step = 0
    model.train()
    loss = aux = None
    while step < cfg.steps:
        if cfg.time_budget_s is not None and time.perf_counter() - start > cfg.time_budget_s:
            progress(f"train: time budget of {cfg.time_budget_s:.0f} s reached at step {step}")
            if loss is not None and (not log or log[-1]["step"] != step):  # the log ends where training did
                log.append(dict(step=step, loss=loss.item(), aux=aux.item() if aux is not None else 0.0,
                                seconds=time.perf_counter() - start))
            break
        idx = torch.randint(0, x_all.shape[0], (cfg.batch,), generator=g, device=device)
        loss = rf_loss(model, x_all[idx], y_all[idx], generator=g)
        aux = model.aux_loss()
        total = loss + aux if aux is not None else loss
        for group in opt.param_groups:
            group["lr"] = cfg.lr * min(1.0, (step + 1) / max(1, cfg.warmup_steps))
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            decay = min(cfg.ema_decay, (1 + step) / (10 + step))  # a short average early on
            for e, p in zip(ema.parameters(), model.parameters()):
                e.lerp_(p, 1 - decay)
        step += 1
        if step % cfg.log_every == 0 or step == cfg.steps:
            entry = dict(step=step, loss=loss.item(), aux=aux.item() if aux is not None else 0.0,
                         seconds=time.perf_counter() - start)
            log.append(entry)
            progress(f"train step {step}/{cfg.steps}: loss {entry['loss']:.4f} aux {entry['aux']:.4f} "
                     f"({entry['seconds']:.0f} s)")
    return ema, log


def save_checkpoint(model: DiTMoE, path: str | Path, meta: dict | None = None) -> Path:
    """The model's config, weights and ``meta`` (numbers and strings) in one file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    torch.save({"config": asdict(model.config), "state": state, "meta": meta or {}}, path)
    return path


def load_checkpoint(path: str | Path, device: torch.device | str = "cpu") -> tuple[DiTMoE, dict]:
    """Read a checkpoint of :func:`save_checkpoint` (``weights_only``: no code runs)."""
    path = Path(path)
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as error:  # noqa: BLE001 - any unreadable file is the caller's bad input
        raise ValueError(f"{path}: not a DiT-MoE checkpoint ({error})") from error
    if not isinstance(blob, dict) or not {"config", "state"} <= set(blob):
        raise ValueError(f"{path}: not a DiT-MoE checkpoint (expected config and state)")
    known = {f.name for f in fields(DiTMoEConfig)}
    config = blob["config"]
    if not isinstance(config, dict) or not set(config) <= known:
        raise ValueError(f"{path}: malformed config {config!r}")
    model = DiTMoE(DiTMoEConfig(**config))
    try:
        model.load_state_dict(blob["state"])
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"{path}: weights do not fit the config ({error})") from error
    return model.to(device).eval(), dict(blob.get("meta") or {})
