"""Random weights defined per parameter and per expert, so any slice of a model can be drawn alone.

A benchmark of a model served on several GPUs needs each rank to hold the attention, the router
and the shared weights, and only its own experts -- without ever building the full expert set on
one rank -- while the result must be exactly the model a single GPU would build. Drawing the
whole model from one generator cannot do that (the values of a tensor depend on everything drawn
before it). Here every tensor has its own seed instead:

* a parameter named ``name`` (its name in ``model.named_parameters()``) is drawn from
  ``stream_seed(seed, name)``;
* the routed experts (stacked ``gate_up_proj [E, 2N, H]`` / ``down_proj [E, H, N]``) are drawn one
  expert at a time, expert ``e`` of ``name`` from ``stream_seed(seed, name, e)``.

So rank r of P draws exactly the rows ``r * E / P ... (r + 1) * E / P - 1`` of the single-process
model's experts, in isolation. Values: normal(0, ``config.initializer_range``) for matrices and
embeddings (what transformers' own init draws for them), ones for norm weights (1-D), zeros for
biases. Draws happen on the target device in float32 and are cast once, so a model built on the
same device type from the same recipe is bitwise the same whatever its rank count.

The model is first built on the ``meta`` device (no memory), its experts modules are given their
local shape, and only then is anything allocated: :func:`seeded_model` never allocates a tensor
of the full expert set unless it is asked for all experts.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

EXPERT_PARAMS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class ExpertShard:
    """Which experts an experts module holds: ``rank``'s contiguous ``num_experts / world_size``.

    Set as ``experts.moekit_shard`` on every experts module of a model built for one rank of
    several; :func:`moekit.integrations.transformers.patch` reads it (the module's weights are then
    the local experts, not all of them)."""

    rank: int
    world_size: int
    num_experts: int

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world_size

    @property
    def first(self) -> int:
        return self.rank * self.experts_per_rank


def stream_seed(seed: int, name: str, expert: int | None = None) -> int:
    """The seed of one tensor (or one expert of a stacked experts tensor): a stable hash, the same
    in every process and Python version (not ``hash()``, which is salted per process)."""
    key = f"{int(seed)}|{name}" + ("" if expert is None else f"|expert={int(expert)}")
    return zlib.crc32(key.encode()) & 0x7FFFFFFF


def _draw(shape, seed: int, device, std: float) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32) * std


def parameter_values(name: str, shape, *, seed: int, std: float, device, dtype,
                     experts: range | None = None) -> torch.Tensor:
    """The recipe's value of parameter ``name`` of the full model's ``shape``; for a stacked experts
    tensor only the experts in ``experts`` (default: all), stacked in order."""
    device = torch.device(device)
    leaf = name.rsplit(".", 1)[-1]
    if leaf in EXPERT_PARAMS and len(shape) == 3:
        chosen = range(shape[0]) if experts is None else experts
        out = torch.empty((len(chosen), *shape[1:]), dtype=dtype, device=device)
        for i, e in enumerate(chosen):
            out[i] = _draw(shape[1:], stream_seed(seed, name, e), device, std).to(dtype)
        return out
    if len(shape) == 1:
        fill = 0.0 if leaf == "bias" else 1.0
        return torch.full(tuple(shape), fill, dtype=dtype, device=device)
    return _draw(tuple(shape), stream_seed(seed, name), device, std).to(dtype)


def is_experts_module(module: nn.Module) -> bool:
    """A transformers routed-experts module: stacked 3-D ``gate_up_proj`` and ``down_proj``."""
    return all(isinstance(getattr(module, p, None), torch.Tensor) and getattr(module, p).dim() == 3
               for p in EXPERT_PARAMS)


def experts_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    return ((n, m) for n, m in model.named_modules() if is_experts_module(m))


def causal_lm_class(config):
    import transformers

    classes = {"OlmoeConfig": "OlmoeForCausalLM", "Qwen3MoeConfig": "Qwen3MoeForCausalLM",
               "MixtralConfig": "MixtralForCausalLM", "Qwen2MoeConfig": "Qwen2MoeForCausalLM"}
    name = classes.get(type(config).__name__)
    if name is None:
        raise ValueError(f"no causal LM class known for {type(config).__name__}; known: {', '.join(classes)}")
    return getattr(transformers, name)


def resolve_config(preset_or_config, layers: int | None = None):
    """A transformers config from a preset name (:mod:`.presets`) or a config object (a copy)."""
    import copy

    if isinstance(preset_or_config, str):
        from moekit.integrations.lm.presets import preset_config

        return preset_config(preset_or_config, layers=layers)
    config = copy.deepcopy(preset_or_config)
    if layers is not None:
        config.num_hidden_layers = layers
    return config


def seeded_model(preset_or_config, *, layers: int | None = None, dtype=torch.float32, device="cpu", seed: int = 0,
                 rank: int = 0, world_size: int = 1) -> nn.Module:
    """A causal LM whose weights follow the per-tensor recipe of this module, in eval mode.

    ``rank`` / ``world_size``: the experts modules hold only the experts of ``rank``
    (``E / world_size`` of them, contiguous) and are tagged with an :class:`ExpertShard`; every other
    weight is the full model's. With ``world_size=1`` this is the whole model. The full expert set
    is never allocated for ``world_size > 1``.
    """
    config = resolve_config(preset_or_config, layers)
    for name, value in (("rank", rank), ("world_size", world_size), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    device = torch.device(device)
    with torch.device("meta"):
        model = causal_lm_class(config)(config)
    std = float(getattr(config, "initializer_range", 0.02))
    full_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    shard = None
    for mod_name, module in experts_modules(model):
        E = module.gate_up_proj.shape[0]
        if E % world_size:
            raise ValueError(f"world_size={world_size} must divide the {E} experts of {mod_name}")
        shard = ExpertShard(rank, world_size, E)
        if world_size > 1:
            local = shard.experts_per_rank
            for p in EXPERT_PARAMS:
                full = getattr(module, p)
                setattr(module, p, nn.Parameter(torch.empty((local, *full.shape[1:]), device="meta", dtype=full.dtype),
                                                requires_grad=False))
            module.moekit_shard = shard
    # Materialize every parameter from the recipe (its own seed), in the target dtype, on the device.
    for name, param in list(model.named_parameters()):
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        shard_of = getattr(owner, "moekit_shard", None)
        chosen = None
        if shard_of is not None and leaf in EXPERT_PARAMS:
            chosen = range(shard_of.first, shard_of.first + shard_of.experts_per_rank)
        value = parameter_values(name, full_shapes[name], seed=seed, std=std, device=device, dtype=dtype,
                                 experts=chosen)
        setattr(owner, leaf, nn.Parameter(value, requires_grad=False))
    _rebuild_buffers(model, device)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def _rebuild_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers are computed by their modules, not drawn: rebuild the modules that hold them (the
    rotary embeddings' inverse frequencies) on ``device``; any other buffer is an error."""
    for name, module in list(model.named_modules()):
        own = dict(module.named_buffers(recurse=False))
        if not own:
            continue
        if not type(module).__name__.endswith("RotaryEmbedding"):
            raise ValueError(f"seeded_model cannot rebuild the buffers {sorted(own)} of {name} "
                             f"({type(module).__name__})")
        parent_name, _, leaf = name.rpartition(".")
        with torch.device(device):
            rebuilt = type(module)(module.config)
        setattr(model.get_submodule(parent_name), leaf, rebuilt)


def iter_checkpoint_tensors(preset_or_config, *, layers: int | None = None, dtype=torch.bfloat16, device="cpu",
                            seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the full model's state, one tensor at a time, from the same recipe as
    :func:`seeded_model` (on ``device``; move them where they are written). For writing a
    checkpoint that transformers' own loaders read, without holding the model."""
    config = resolve_config(preset_or_config, layers)
    with torch.device("meta"):
        model = causal_lm_class(config)(config)
    std = float(getattr(config, "initializer_range", 0.02))
    tied = model.config.tie_word_embeddings
    for name, param in model.named_parameters():
        if tied and name == "lm_head.weight":
            continue
        yield name, parameter_values(name, tuple(param.shape), seed=seed, std=std, device=device, dtype=dtype)
