"""DiT-MoE: a class-conditional diffusion transformer whose FFNs are MoE layers.

The architecture of the public DiT-MoE release, written here from its description:

* patchify (p x p patches of the latent, one linear map each — a stride-p convolution),
  fixed 2-D sine-cosine position embeddings;
* a sinusoidal timestep embedding through a SiLU MLP, and a class embedding with one extra
  "null" class for classifier-free guidance (labels dropped with ``class_dropout`` in
  training); their sum ``c`` conditions every block;
* ``depth`` blocks with adaLN-Zero: ``c`` gives six modulation vectors (shift, scale and
  gate for attention and for the FFN) from a zero-initialized linear map, so every block
  starts as the identity;
* multi-head self-attention (qkv with bias, output projection);
* an MoE FFN: a softmax router over E experts, top-K of them per token with their
  probabilities as weights (no renormalization), SwiGLU experts of width 4H, plus a shared
  SwiGLU expert (two experts' worth of width, fused) that every token goes through;
* a final adaLN layer and a zero-initialized linear map back to patches, then unpatchify.

The MoE FFN is pluggable: ``forward(..., moe=runner)`` hands each block's normalized,
modulated tokens ``h[T, H]`` to ``runner(layer, h)``. Without a runner the block's own
weights compute it in this process (training, single-device sampling); the DICE schedules
(:class:`moekit.dice.runner.ScheduledMoE`) run it through any moekit Dispatcher, and the
staleness simulator (:class:`moekit.dice.simulator.StalenessSimulator`) on one process.
Every routed expert output is combined with :func:`moekit.ep.weighted_slot_sum` (float32,
slot order), the contract every dispatcher's combine follows.

``set_batch_invariant(True)`` routes every linear map through
:func:`moekit.dice.exact.rowwise_linear` so that a token's arithmetic does not depend on
its batch: the mode the bitwise simulator checks run in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.nn import functional as F

from moekit.dice.exact import expert_mlp, linear
from moekit.ep.dispatcher import weighted_slot_sum
from moekit.moe.experts import MoEWeights
from moekit.shapes import MoEShape, get_shape


@dataclass(frozen=True)
class DiTMoEConfig:
    """Sizes of a DiT-MoE. ``expert_intermediate`` / ``shared_intermediate`` of 0 mean the
    release's defaults: 4 * hidden per routed expert, hidden per shared expert."""

    name: str = "custom"
    input_size: int = 32  # latent side (a 256 x 256 image through an 8x VAE)
    patch_size: int = 2
    in_channels: int = 4
    hidden: int = 384
    depth: int = 12
    num_heads: int = 6
    num_experts: int = 8
    top_k: int = 2
    expert_intermediate: int = 0
    num_shared_experts: int = 2
    shared_intermediate: int = 0
    num_classes: int = 1000
    class_dropout: float = 0.1
    aux_loss_alpha: float = 0.01  # load-balancing loss weight in training
    t_scale: float = 1000.0  # flow time t in [0, 1] enters the sinusoidal embedding as t * t_scale

    def __post_init__(self) -> None:
        for field in ("input_size", "patch_size", "in_channels", "hidden", "depth", "num_heads", "num_experts",
                      "top_k", "num_classes"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DiTMoEConfig.{field} must be a positive int, got {value!r}")
        for field in ("expert_intermediate", "num_shared_experts", "shared_intermediate"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"DiTMoEConfig.{field} must be an int >= 0, got {value!r}")
        if self.input_size % self.patch_size:
            raise ValueError(f"input_size={self.input_size} must be a multiple of patch_size={self.patch_size}")
        if self.hidden % self.num_heads or (self.hidden // self.num_heads) % 2:
            raise ValueError(f"hidden={self.hidden} must be num_heads={self.num_heads} times an even head size")
        if self.hidden % 4:
            raise ValueError(f"hidden={self.hidden} must be a multiple of 4 (2-D sine-cosine position embedding)")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if not 0.0 <= self.class_dropout < 1.0:
            raise ValueError(f"class_dropout must be in [0, 1), got {self.class_dropout}")
        if self.expert_intermediate == 0:
            object.__setattr__(self, "expert_intermediate", 4 * self.hidden)
        if self.shared_intermediate == 0:
            object.__setattr__(self, "shared_intermediate", self.hidden)

    @property
    def tokens_per_image(self) -> int:
        return (self.input_size // self.patch_size) ** 2

    @property
    def moe_shape(self) -> MoEShape:
        return MoEShape(self.name, num_experts=self.num_experts, top_k=self.top_k, hidden=self.hidden,
                        intermediate=self.expert_intermediate, num_shared_experts=self.num_shared_experts,
                        shared_intermediate=self.shared_intermediate if self.num_shared_experts else 0,
                        num_layers=self.depth)

    def scaled(self, **changes) -> "DiTMoEConfig":
        """A copy with some fields changed (widths left at 0 follow the new hidden size)."""
        if "hidden" in changes:
            changes.setdefault("expert_intermediate", 0)
            changes.setdefault("shared_intermediate", 0)
        return replace(self, **changes)


def _from_shape(shape_name: str, num_heads: int) -> DiTMoEConfig:
    s = get_shape(shape_name)
    return DiTMoEConfig(name=shape_name, hidden=s.hidden, depth=s.num_layers, num_heads=num_heads,
                        num_experts=s.num_experts, top_k=s.top_k, expert_intermediate=s.intermediate,
                        num_shared_experts=s.num_shared_experts, shared_intermediate=s.shared_intermediate)


# S and B follow DiT-S/2 and DiT-B/2 with the release's 8-expert, top-2 MoE; XL and G are the
# released models (their MoE shapes live in moekit.shapes).
PRESETS: dict[str, DiTMoEConfig] = {
    "dit-moe-s": DiTMoEConfig(name="dit-moe-s", hidden=384, depth=12, num_heads=6),
    "dit-moe-b": DiTMoEConfig(name="dit-moe-b", hidden=768, depth=12, num_heads=12),
    "dit-moe-xl": _from_shape("dit-moe-xl", num_heads=16),
    "dit-moe-g": _from_shape("dit-moe-g", num_heads=16),
}


def digits_config(**changes) -> DiTMoEConfig:
    """A small DiT-MoE for 8 x 8 single-channel digit images (10 classes, 2 x 2 patches)."""
    base = DiTMoEConfig(name="dit-moe-digits", input_size=8, patch_size=2, in_channels=1, hidden=128, depth=6,
                        num_heads=4, num_classes=10)
    return base.scaled(**changes) if changes else base


PRESETS["dit-moe-digits"] = digits_config()


def get_config(name: str) -> DiTMoEConfig:
    """The preset called ``name``; a ValueError lists the known names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown DiT-MoE preset {name!r}; known: {', '.join(PRESETS)}") from None


# ----------------------------------------------------------------------------- embeddings


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def sincos_2d(dim: int, grid: int) -> torch.Tensor:
    """Fixed 2-D sine-cosine position embedding [grid * grid, dim] (half for rows, half for columns)."""
    def one_axis(d: int, pos: torch.Tensor) -> torch.Tensor:
        omega = 1.0 / 10000 ** (torch.arange(d // 2, dtype=torch.float64) / (d / 2))
        angles = pos.reshape(-1, 1) * omega.reshape(1, -1)
        return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)

    coords = torch.arange(grid, dtype=torch.float64)
    rows, cols = torch.meshgrid(coords, coords, indexing="ij")
    return torch.cat([one_axis(dim // 2, rows), one_axis(dim // 2, cols)], dim=1).float()


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding [B, dim] of (fractional) times t [B]: cosines then sines."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float().unsqueeze(1) * freqs.unsqueeze(0)
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=1)
    return emb if dim % 2 == 0 else torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=1)


FREQ_DIM = 256  # width of the sinusoidal timestep features


# ------------------------------------------------------------------------------ the MoE FFN


def route(h: torch.Tensor, router: torch.Tensor, top_k: int, *,
          batch_invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DiT-MoE's router: softmax over the E experts (float32), the top-k by probability.

    Returns ``(probs[T, E], topk_weights[T, K], topk_ids[T, K])``; slot 0 is each token's
    top-1 expert, and the weights are the probabilities themselves (no renormalization),
    so they are bitwise ``probs.gather(1, topk_ids)``.
    """
    logits = linear(h.float(), router.float(), batch_invariant=batch_invariant)
    probs = torch.softmax(logits, dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return probs, weights, ids


def slot_outputs(h: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
                 batch_invariant: bool = False) -> torch.Tensor:
    """Every (token, slot)'s expert output, unweighted: [T, K, H]. One host read (the
    rows per expert). Differentiable: the training path and single-device inference use it."""
    T, K = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    rows = h.repeat_interleave(K, dim=0)[order]
    outs = [expert_mlp(chunk, w13[e], w2[e], batch_invariant=batch_invariant)
            for e, chunk in enumerate(torch.split(rows, counts)) if chunk.shape[0]]
    out = torch.cat(outs) if outs else rows[:0]
    return torch.empty_like(out).index_copy(0, order, out).view(T, K, h.shape[1])  # back to (token, slot) order


class MoEFFN(nn.Module):
    """The MoE FFN of one block: router [E, H], experts w13 [E, 2N, H] / w2 [E, H, N]
    (moekit's stacked SwiGLU layout), shared expert shared_w13 [2S, H] / shared_w2 [H, S]."""

    def __init__(self, config: DiTMoEConfig, generator: torch.Generator):
        super().__init__()
        H, N, E = config.hidden, config.expert_intermediate, config.num_experts
        self.top_k, self.aux_loss_alpha = config.top_k, config.aux_loss_alpha
        self.router = nn.Parameter(_uniform((E, H), H ** -0.5, generator))
        self.w13 = nn.Parameter(_xavier((E, 2 * N, H), H, N, generator))
        self.w2 = nn.Parameter(_xavier((E, H, N), N, H, generator))
        if config.num_shared_experts:
            S = config.num_shared_experts * config.shared_intermediate
            self.shared_w13 = nn.Parameter(_xavier((2 * S, H), H, S, generator))
            self.shared_w2 = nn.Parameter(_xavier((H, S), S, H, generator))
        else:
            self.shared_w13 = self.shared_w2 = None
        self.aux_loss: torch.Tensor | None = None

    def forward(self, h: torch.Tensor, *, batch_invariant: bool = False) -> torch.Tensor:
        probs, weights, ids = route(h, self.router, self.top_k, batch_invariant=batch_invariant)
        out = slot_outputs(h, ids, self.w13, self.w2, batch_invariant=batch_invariant)
        y = weighted_slot_sum(out, ids, weights, h.dtype)
        if self.training and self.aux_loss_alpha > 0:
            # The release's balance loss: alpha * sum_e (mean probability of e) * (E * share of slots to e).
            share = torch.bincount(ids.reshape(-1), minlength=probs.shape[1]).float() / ids.numel()
            self.aux_loss = self.aux_loss_alpha * (probs.mean(0) * share * probs.shape[1]).sum()
        return y + self.shared(h, batch_invariant=batch_invariant)

    def shared(self, h: torch.Tensor, *, batch_invariant: bool = False) -> torch.Tensor:
        if self.shared_w13 is None:
            return torch.zeros_like(h)
        return expert_mlp(h, self.shared_w13, self.shared_w2, batch_invariant=batch_invariant).to(h.dtype)

    def weights(self) -> MoEWeights:
        """A detached copy as moekit's :class:`MoEWeights` (the router stays float32)."""
        def copy(p):
            return None if p is None else p.detach().clone()
        return MoEWeights(self.router.detach().float().clone(), copy(self.w13), copy(self.w2),
                          copy(self.shared_w13), copy(self.shared_w2))


def _uniform(size, bound: float, g: torch.Generator) -> torch.Tensor:
    return (torch.rand(*size, generator=g) * 2 - 1) * bound


def _xavier(size, fan_in: int, fan_out: int, g: torch.Generator) -> torch.Tensor:
    return _uniform(size, math.sqrt(6.0 / (fan_in + fan_out)), g)


def _init_linear(layer: nn.Linear, g: torch.Generator, *, zero: bool = False, std: float | None = None) -> nn.Linear:
    with torch.no_grad():
        if zero:
            layer.weight.zero_()
        elif std is not None:
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=g) * std)
        else:
            layer.weight.copy_(_xavier(layer.weight.shape, layer.in_features, layer.out_features, g))
        if layer.bias is not None:
            layer.bias.zero_()
    return layer


# ---------------------------------------------------------------------------------- blocks


class DiTBlock(nn.Module):
    """adaLN-Zero block: x += gate_msa * attn(mod(norm(x))); x += gate_mlp * moe(mod(norm(x)))."""

    def __init__(self, config: DiTMoEConfig, g: torch.Generator, adaln_zero: bool = True):
        super().__init__()
        H = config.hidden
        self.num_heads = config.num_heads
        self.qkv = _init_linear(nn.Linear(H, 3 * H), g)
        self.proj = _init_linear(nn.Linear(H, H), g)
        self.adaln = _init_linear(nn.Linear(H, 6 * H), g, zero=adaln_zero)
        self.moe = MoEFFN(config, g)

    def forward(self, x: torch.Tensor, c: torch.Tensor, layer: int, moe, bi: bool) -> torch.Tensor:
        B, N, H = x.shape
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = linear(F.silu(c), self.adaln.weight, self.adaln.bias,
                                                                     batch_invariant=bi).chunk(6, dim=1)
        h = modulate(F.layer_norm(x, (H,), eps=1e-6), shift_a, scale_a)
        x = x + gate_a.unsqueeze(1) * self.attention(h, bi)
        h = modulate(F.layer_norm(x, (H,), eps=1e-6), shift_m, scale_m).reshape(B * N, H)
        y = self.moe(h, batch_invariant=bi) if moe is None else moe(layer, h)
        return x + gate_m.unsqueeze(1) * y.reshape(B, N, H)

    def attention(self, x: torch.Tensor, bi: bool) -> torch.Tensor:
        B, N, H = x.shape
        heads, d = self.num_heads, H // self.num_heads
        qkv = linear(x, self.qkv.weight, self.qkv.bias, batch_invariant=bi)
        q, k, v = qkv.reshape(B, N, 3, heads, d).permute(2, 0, 3, 1, 4).unbind(0)  # [B, heads, N, d]
        if bi:  # one matrix product per (sample, head): batch-invariant, unlike the fused kernels
            q, k, v = (t.reshape(B * heads, N, d) for t in (q, k, v))
            scores = torch.bmm(q * d ** -0.5, k.transpose(1, 2))
            o = torch.bmm(torch.softmax(scores, dim=-1), v).reshape(B, heads, N, d)
        else:
            o = F.scaled_dot_product_attention(q, k, v)
        return linear(o.transpose(1, 2).reshape(B, N, H), self.proj.weight, self.proj.bias, batch_invariant=bi)


class DiTMoE(nn.Module):
    """``forward(x[B, C, S, S], t[B] in [0, 1], y[B] labels, moe=None) -> velocity [B, C, S, S]``.

    Label ``num_classes`` is the null class (classifier-free guidance). ``seed`` makes the
    initial weights reproducible on every rank. ``adaln_zero=False`` draws the modulation
    and output maps at random instead of zero, so that an untrained model's blocks (and
    their MoE layers) already shape the output: what tests of the schedules need.
    """

    def __init__(self, config: DiTMoEConfig, *, seed: int = 0, adaln_zero: bool = True):
        super().__init__()
        self.config = config
        g = torch.Generator().manual_seed(seed)
        H, p, C = config.hidden, config.patch_size, config.in_channels
        self.patch = _init_linear(nn.Linear(C * p * p, H), g)
        self.register_buffer("pos_embed", sincos_2d(H, config.input_size // p).unsqueeze(0), persistent=False)
        self.t_mlp1 = _init_linear(nn.Linear(FREQ_DIM, H), g, std=0.02)
        self.t_mlp2 = _init_linear(nn.Linear(H, H), g, std=0.02)
        self.label_embed = nn.Embedding(config.num_classes + 1, H)
        with torch.no_grad():
            self.label_embed.weight.copy_(torch.randn(self.label_embed.weight.shape, generator=g) * 0.02)
        self.blocks = nn.ModuleList(DiTBlock(config, g, adaln_zero) for _ in range(config.depth))
        self.final_adaln = _init_linear(nn.Linear(H, 2 * H), g, zero=adaln_zero)
        self.final = _init_linear(nn.Linear(H, p * p * C), g, zero=adaln_zero)
        self.batch_invariant = False

    def set_batch_invariant(self, flag: bool = True) -> "DiTMoE":
        """Compute every linear map row by row (see :mod:`moekit.dice.exact`)."""
        self.batch_invariant = bool(flag)
        return self

    @property
    def null_class(self) -> int:
        return self.config.num_classes

    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        B, C, S, _ = x.shape
        p, n = self.config.patch_size, S // self.config.patch_size
        return x.reshape(B, C, n, p, n, p).permute(0, 2, 4, 1, 3, 5).reshape(B, n * n, C * p * p)

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        p, C, n = self.config.patch_size, self.config.in_channels, self.config.input_size // self.config.patch_size
        return x.reshape(B, n, n, C, p, p).permute(0, 3, 1, 4, 2, 5).reshape(B, C, n * p, n * p)

    def condition(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """c = timestep embedding + class embedding, [B, H]."""
        bi = self.batch_invariant
        dtype = self.patch.weight.dtype
        freq = timestep_embedding(t * self.config.t_scale, FREQ_DIM).to(dtype)
        temb = linear(F.silu(linear(freq, self.t_mlp1.weight, self.t_mlp1.bias, batch_invariant=bi)),
                      self.t_mlp2.weight, self.t_mlp2.bias, batch_invariant=bi)
        return temb + self.label_embed(y)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, moe=None) -> torch.Tensor:
        cfg, bi = self.config, self.batch_invariant
        if x.dim() != 4 or tuple(x.shape[1:]) != (cfg.in_channels, cfg.input_size, cfg.input_size):
            raise ValueError(f"x must be [B, {cfg.in_channels}, {cfg.input_size}, {cfg.input_size}], "
                             f"got {tuple(x.shape)}")
        if t.shape != (x.shape[0],) or y.shape != (x.shape[0],):
            raise ValueError(f"t and y must be [B={x.shape[0]}], got {tuple(t.shape)} and {tuple(y.shape)}")
        h = linear(self.patchify(x), self.patch.weight, self.patch.bias, batch_invariant=bi) + self.pos_embed
        c = self.condition(t, y)
        for layer, block in enumerate(self.blocks):
            h = block(h, c, layer, moe, bi)
        shift, scale = linear(F.silu(c), self.final_adaln.weight, self.final_adaln.bias,
                              batch_invariant=bi).chunk(2, dim=1)
        h = modulate(F.layer_norm(h, (cfg.hidden,), eps=1e-6), shift, scale)
        return self.unpatchify(linear(h, self.final.weight, self.final.bias, batch_invariant=bi))

    def forward_with_cfg(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, cfg_scale: float,
                         moe=None) -> torch.Tensor:
        """Classifier-free guidance in one batch: rows [x | x] with labels [y | null];
        v = v_null + cfg_scale * (v_y - v_null). ``cfg_scale == 1`` skips the null half."""
        if cfg_scale == 1.0:
            return self(x, t, y, moe)
        B = x.shape[0]
        v = self(torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, torch.full_like(y, self.null_class)]), moe)
        v_cond, v_null = v[:B], v[B:]
        return v_null + cfg_scale * (v_cond - v_null)

    def moe_weights(self) -> list[MoEWeights]:
        """Every block's MoE FFN as :class:`MoEWeights` (detached copies), layer by layer."""
        return [block.moe.weights() for block in self.blocks]

    def aux_loss(self) -> torch.Tensor | None:
        """The summed load-balancing loss of the last training forward (None outside training)."""
        losses = [b.moe.aux_loss for b in self.blocks if b.moe.aux_loss is not None]
        return torch.stack(losses).sum() if losses else None
