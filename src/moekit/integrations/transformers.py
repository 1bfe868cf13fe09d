"""Run Hugging Face ``transformers`` MoE models on moekit.

::

    from transformers import AutoModelForCausalLM
    from moekit.integrations.transformers import patch, unpatch

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    patch(model, experts="fused")          # the MoE blocks now run on moekit
    out = model.generate(ids, max_new_tokens=32)
    unpatch(model)                         # back to transformers' own experts

What changes and what does not. A transformers MoE block is a router (``block.gate``), the
routed experts (``block.experts``: stacked SwiGLU weights ``gate_up_proj [E, 2N, H]`` and
``down_proj [E, H, N]``) and, for some models, shared experts. :func:`patch` replaces only
the routed experts' computation: every token goes through a moekit
:class:`~moekit.ep.Dispatcher` to moekit's expert compute (``"torch"``:
:class:`~moekit.moe.SwiGLUExperts`; ``"fused"`` / ``"fused_fp8"``:
:class:`~moekit.moe.FusedExperts`) and back through the dispatcher's combine. The router,
the shared experts and their gate stay the model's own modules, so the routing is exactly
what the model defines (softmax-then-top-k with or without renormalization for OLMoE,
Qwen2-MoE and Qwen3-MoE; Mixtral's renormalized top-2; DeepSeek-V3's sigmoid scores, score
bias, grouped top-k and scaling factor; Qwen2-MoE's sigmoid-gated shared expert).

Two ways in:

* ``method="interface"`` (the default wherever it applies): transformers' own extension
  point for MoE experts. transformers 5 dispatches an experts module's forward by
  ``config._experts_implementation`` through its ``ExpertsInterface``; moekit registers
  an implementation named ``"moekit"`` there and points the model's config at it. The
  modules and their parameter names do not change.
* ``method="swap"``: each block's ``experts`` module is replaced by a
  :class:`MoekitExperts` holding the same parameters under the same names (used for an
  experts class that does not take part in the extension point; selectable for any).

Weights are shared, not copied: ``"torch"`` and ``"fused"`` run on the model's own
``gate_up_proj`` / ``down_proj`` storage (on each rank, a view of the experts it owns).
The one copy is ``"fused_fp8"``: the W8A8 kernel needs e4m3 weights with 128 x 128 block
scales, quantized once per block when patched (1 byte per weight plus the scales), while
the model keeps its originals for :func:`unpatch` and for a later re-quantization. If the
model's weights move (``model.to(...)``) the compute is rebuilt on the next call.

Expert parallelism: pass a dispatcher built on a process group (``torchrun``; one per
process, e.g. :class:`~moekit.ep.AllToAllDispatcher`). Each rank then runs its own batch
through the whole model (attention replicated, data parallel) and its experts
``rank * E / P ... (rank + 1) * E / P - 1``; every rank must call the MoE blocks the same
number of times (for ``generate()``: the same ``max_new_tokens`` with
``min_new_tokens`` equal to it, so no rank stops early).

A model built for one rank of several (:func:`moekit.integrations.lm.build_expert_parallel`)
holds only that rank's experts: its experts modules carry a ``moekit_shard`` saying which, and
patch runs them as this rank's experts (the dispatcher must be of that rank and world size).
Such a model runs only patched: transformers' own experts would need all of them.

Supported: transformers >= 5.0 (the release that introduced the experts extension point)
and the blocks in :data:`SUPPORTED_BLOCKS`. Any other MoE block raises ``ValueError``
naming its type; so does a model with no MoE block.

Routing is observable: every patched block owns a :class:`RoutingTap` that sees its
``(topk_ids, topk_weights)``; :func:`routing_taps` lists them in layer order for a
:class:`moekit.routing.RoutingRecorder`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _torch_module

from moekit.ep.dispatcher import run_experts
from moekit.fp8 import dequantize_groups
from moekit.moe import EXPERT_KINDS, FusedExperts, SwiGLUExperts
from moekit.moe.experts import check_expert_tokens, swiglu_expert_major, swiglu_token_major

IMPLEMENTATION = "moekit"  # the name registered in transformers' ExpertsInterface
METHODS = ("auto", "interface", "swap")
MIN_TRANSFORMERS = (5, 0)

# MoE block class -> the transformers module that defines it. Matched on both, so a
# look-alike class of another model is not taken for a supported one.
SUPPORTED_BLOCKS = {
    "OlmoeSparseMoeBlock": "transformers.models.olmoe.modeling_olmoe",
    "Qwen3MoeSparseMoeBlock": "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "MixtralSparseMoeBlock": "transformers.models.mixtral.modeling_mixtral",
    "Qwen2MoeSparseMoeBlock": "transformers.models.qwen2_moe.modeling_qwen2_moe",
    "DeepseekV3MoE": "transformers.models.deepseek_v3.modeling_deepseek_v3",
}


class RoutingTap(nn.Module):
    """Identity on ``(topk_ids, topk_weights)``: the point a RoutingRecorder hooks.

    Its forward returns what it is given, in the router contract
    ``(topk_ids [T, K], topk_weights [T, K])`` that :class:`moekit.routing.RoutingRecorder`
    expects (a transformers router returns logits first).
    """

    def __init__(self, layer: int, name: str):
        super().__init__()
        self.layer, self.name = layer, name

    def forward(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        return topk_ids, topk_weights

    def extra_repr(self) -> str:
        return f"layer={self.layer}, block={self.name!r}"


@dataclass
class _Backend:
    """moekit's side of one patched block: what runs its routed experts."""

    experts_kind: str
    dispatcher: Any
    rank: int
    world_size: int
    kernel_config: Any
    tap: RoutingTap
    top_k: int | None = None
    compute: nn.Module | None = None
    built_from: tuple = ()  # (storage pointers, dtype, device) of the weights the compute was built on

    def local_slice(self, experts: nn.Module) -> slice:
        if getattr(experts, "moekit_shard", None) is not None:  # the module holds this rank's experts only
            return slice(0, experts.gate_up_proj.shape[0])
        E_local = experts.gate_up_proj.shape[0] // self.world_size
        return slice(self.rank * E_local, (self.rank + 1) * E_local)

    def local_weights(self, experts: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's experts, as views of the model's stacked weights (no copy)."""
        own = self.local_slice(experts)
        return experts.gate_up_proj.detach()[own], experts.down_proj.detach()[own]

    def compute_for(self, experts: nn.Module) -> nn.Module:
        """The compute, rebuilt where the model's weights moved since it was built (eager calls).

        A compiled forward cannot read storage pointers: it runs the compute it finds, which
        must have been built for the weights' dtype and device (by ``patch`` or an eager call)."""
        params = experts._parameters  # (read directly: this runs at every experts call)
        w13, w2 = params.get("gate_up_proj"), params.get("down_proj")
        if w13 is None or w2 is None:
            w13, w2 = experts.gate_up_proj, experts.down_proj
        if torch.compiler.is_compiling():
            if self.compute is None or self.built_from[2:] != (w13.dtype, w13.device):
                raise RuntimeError("the patched model's weights moved since moekit last ran them: run one eager "
                                   "forward (or patch again) before compiling it")
            return self.compute
        key = (w13.data_ptr(), w2.data_ptr(), w13.dtype, w13.device)
        if self.compute is None or key != self.built_from:
            if self.experts_kind == "torch":
                self.compute = ModelTorchExperts(experts, self.local_slice(experts))
            else:
                self.compute = FusedExperts(*self.local_weights(experts), config=self.kernel_config,
                                            fp8=self.experts_kind == "fused_fp8", top_k=self.top_k)
            self.built_from = key
        return self.compute

    def run(self, experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor) -> torch.Tensor:
        tap = self.tap
        if tap._forward_hooks or tap._forward_pre_hooks or _global_module_hooks():
            top_k_index, top_k_weights = tap(top_k_index, top_k_weights)  # a recorder is listening
        ids, weights = top_k_index, top_k_weights
        compute = self.compute_for(experts)
        exchange = _exchange if getattr(self.dispatcher, "compile_traceable", False) else _exchange_eagerly
        y = exchange(self.dispatcher, compute, hidden_states, ids, weights)
        return y if y.dtype == hidden_states.dtype else y.to(hidden_states.dtype)


def _exchange(dispatcher, compute: nn.Module, hidden_states: torch.Tensor, ids: torch.Tensor,
              weights: torch.Tensor) -> torch.Tensor:
    """Dispatch, the experts, combine."""
    dispatched = dispatcher.dispatch(hidden_states, ids, weights)
    return dispatcher.combine(run_experts(compute, dispatched), dispatched)


# The expert-parallel dispatchers read message sizes or step statuses on the host and launch
# their own kernels: torch.compile must not trace into them (under fake tensors they fail), so
# a compiled model breaks its graph around the exchange and runs it as it is.
_exchange_eagerly = torch.compiler.disable(_exchange)


def _global_module_hooks() -> bool:
    """Whether global module hooks are registered (they would see the tap's call too)."""
    return bool(_torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks)


class ModelTorchExperts(nn.Module):
    """moekit's torch experts on a transformers experts module's own parameters, read at every
    call (this rank's slice of them): nothing is copied, a change to the weights is what runs
    next, and autograd reaches the model's parameters (a patched model trains with
    ``experts="torch"``). Both layouts, as :class:`~moekit.moe.SwiGLUExperts`."""

    layouts = SwiGLUExperts.layouts
    sums_slots = SwiGLUExperts.sums_slots

    def __init__(self, experts: nn.Module, own: slice):
        super().__init__()
        self.__dict__["_experts"] = experts  # not a submodule: the model owns it
        self.own = own

    @property
    def w13(self) -> torch.Tensor:
        return self._experts.gate_up_proj[self.own]

    @property
    def w2(self) -> torch.Tensor:
        return self._experts.down_proj[self.own]

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor | None = None,
                scales: torch.Tensor | None = None) -> torch.Tensor:
        w13, w2 = self.w13, self.w2
        check_expert_tokens(tokens, scales, w13.shape[0], w13.shape[2])
        if scales is not None:
            tokens = dequantize_groups(tokens, scales, w13.dtype)
        return swiglu_expert_major(tokens.to(w13.dtype), w13, w2)

    def token_major(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None = None,
                    scales: torch.Tensor | None = None) -> torch.Tensor:
        w13, w2 = self.w13, self.w2
        if scales is not None:
            x = dequantize_groups(x, scales, w13.dtype)
        return swiglu_token_major(x.to(w13.dtype), topk_ids, w13, w2)


def _moekit_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``"moekit"`` entry of transformers' ExpertsInterface.

    An experts module reaches it when its config names ``"moekit"``. A module that shares
    such a config without being patched itself (another model built from the same config
    object) runs the implementation its config had before patching.
    """
    backend = self.__dict__.get("_moekit_backend")
    if backend is not None:
        return backend.run(self, hidden_states, top_k_index, top_k_weights)
    previous = _PREVIOUS_IMPLEMENTATION.get(id(self.config), (None, "eager"))[1]
    return _implementation(self, previous)(self, hidden_states, top_k_index, top_k_weights)


def _implementation(experts: nn.Module, name: str | None):
    """The experts forward transformers would run for implementation ``name``."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if name in (None, "eager") or name not in ALL_EXPERTS_FUNCTIONS:
        return type(experts).forward.__wrapped__  # the class's own loop, under the decorator
    return ALL_EXPERTS_FUNCTIONS[name]


# id(config) -> (config, its implementation before patching); _CONFIG_USERS counts the patched
# models using that config. The config object is held so its id cannot be reused meanwhile.
_PREVIOUS_IMPLEMENTATION: dict[int, tuple[Any, str | None]] = {}
_CONFIG_USERS: dict[int, int] = {}


class MoekitExperts(nn.Module):
    """A transformers experts module's replacement for ``method="swap"``.

    Same call (``forward(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K])``)
    and the same parameters, registered under the same names (``gate_up_proj``,
    ``down_proj``), so ``state_dict()`` keys and tied references are unchanged.
    """

    def __init__(self, original: nn.Module, backend: _Backend):
        super().__init__()
        self.gate_up_proj = original.gate_up_proj
        self.down_proj = original.down_proj
        self.num_experts = original.gate_up_proj.shape[0]
        self.original_class = type(original).__name__
        self.__dict__["_moekit_original"] = original  # for unpatch; not a submodule
        self.__dict__["_moekit_backend"] = backend

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return self._moekit_backend.run(self, hidden_states, top_k_index, top_k_weights)

    def extra_repr(self) -> str:
        b = self._moekit_backend
        return f"replaces={self.original_class}, experts={b.experts_kind!r}, rank={b.rank}/{b.world_size}"


@dataclass
class PatchedBlock:
    """One MoE block moekit runs: where it is, how it was patched, and its routing tap."""

    name: str  # the block's module name in the model
    block_type: str
    layer: int  # index among the model's MoE blocks
    method: str  # "interface" or "swap"
    tap: RoutingTap
    backend: _Backend
    block: nn.Module = field(repr=False)
    original_experts: nn.Module = field(repr=False)


@dataclass
class _PatchState:
    blocks: list[PatchedBlock]
    configs: list[Any]  # configs switched to the "moekit" implementation
    previous: list[str | None] = field(default_factory=list)  # each config's implementation before
    hooks: list = field(default_factory=list)  # the step scope's forward hooks (RaMP policies)


# -------------------------------------------------------------------------- public API


def transformers_version() -> tuple[int, ...]:
    """The installed transformers' (major, minor), or ValueError when it is missing or too old."""
    try:
        import transformers
    except ImportError:
        raise ValueError("moekit.integrations.transformers needs transformers: pip install 'moekit[hf]'") from None
    parts = []
    for piece in transformers.__version__.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    version = tuple(parts)
    if version < MIN_TRANSFORMERS:
        raise ValueError(f"moekit.integrations.transformers needs transformers >= "
                         f"{'.'.join(map(str, MIN_TRANSFORMERS))}, found {transformers.__version__}")
    return version


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, block)`` of every MoE block of ``model`` in module order (= layer order).

    A module counts as an MoE block when it has an ``experts`` submodule. Raises ValueError
    naming the type of every block moekit does not support, or when there is none.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module (a transformers model), got {type(model).__name__}")
    blocks, unsupported = [], {}
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if not isinstance(experts, nn.Module):
            continue
        if SUPPORTED_BLOCKS.get(type(module).__name__) == type(module).__module__:
            blocks.append((name, module))
        else:
            unsupported.setdefault(f"{type(module).__module__}.{type(module).__name__}", name)
    supported = ", ".join(SUPPORTED_BLOCKS)
    if unsupported:
        listed = "; ".join(f"{kind} (at {where or 'the model'})" for kind, where in unsupported.items())
        raise ValueError(f"unsupported MoE block type {listed} in {type(model).__name__}; "
                         f"moekit supports {supported}")
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no MoE block (a module with an 'experts' submodule); "
                         f"moekit supports {supported}")
    return blocks


def patch(model: nn.Module, experts: str = "torch", dispatcher=None, *, kernel_config=None,
          method: str = "auto") -> list[PatchedBlock]:
    """Run every MoE block of ``model`` on moekit; returns the patched blocks in layer order.

    ``experts``: ``"torch"``, ``"fused"`` or ``"fused_fp8"`` (the fused ones need Triton and,
    in practice, a GPU; ``"fused_fp8"`` needs H and N to be multiples of 128).
    ``dispatcher``: a :class:`moekit.ep.Dispatcher`, or None for the eager
    :class:`~moekit.ep.AllToAllDispatcher` over the default process group (expert parallel
    when one is initialized, as under ``torchrun``; a single process otherwise). ``kernel_config``: the fused kernel's
    :class:`moekit.kernels.KernelConfig`, ``"default"`` (the kernel's static default), ``"auto"`` or
    ``"ramp"`` / None (RaMP's routing-aware choice: :class:`moekit.moe.FusedExperts` says how each reads the routing). ``method``: ``"auto"``
    (transformers' experts interface where the experts class takes part in it, else the
    module swap), ``"interface"`` or ``"swap"``.

    Raises ValueError for an unsupported or already patched model, an experts layout moekit
    cannot run (weights not ``[E, 2N, H]`` / ``[E, H, N]``, biases, another activation than
    SiLU), a dispatcher whose expert count or world size does not fit, or a bad argument.
    Nothing is changed when it raises.
    """
    transformers_version()
    if experts not in EXPERT_KINDS:
        raise ValueError(f"experts must be one of {EXPERT_KINDS}, got {experts!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if kernel_config is not None and experts == "torch":
        raise ValueError("kernel_config is for the fused experts (experts='fused' or 'fused_fp8')")
    if is_patched(model):
        raise ValueError(f"{type(model).__name__} is already patched by moekit: unpatch(model) first")
    found = moe_blocks(model)
    for name, block in found:
        _check_experts_layout(name, block)
    num_experts = _total_experts(found[0][1].experts)
    hidden, top_k = found[0][1].experts.gate_up_proj.shape[2], _top_k(found[0][1])
    dispatcher, rank, world_size = _resolve_dispatcher(dispatcher, num_experts, hidden, top_k)
    for name, block in found:
        _check_shard(name, block.experts, rank, world_size)
    plans = [(name, block, _choose_method(block, method)) for name, block in found]

    patched = []
    for layer, (name, block, how) in enumerate(plans):
        tap = RoutingTap(layer, name)
        backend = _Backend(experts, dispatcher, rank, world_size, kernel_config, tap, top_k=top_k)
        backend.compute_for(block.experts)  # build (and quantize) now: errors surface here, not mid-generate
        patched.append(PatchedBlock(name, type(block).__name__, layer, how, tap, backend, block, block.experts))
    configs = _apply(patched)
    previous = [_PREVIOUS_IMPLEMENTATION[id(c)][1] for c in configs]
    hooks = _step_scope(model) if kernel_config in ("ramp", "auto") else []
    model.__dict__["_moekit_patch"] = _PatchState(patched, configs, previous, hooks)
    return patched


def _step_scope(model: nn.Module) -> list:
    """RaMP's routing reads are shared by the MoE layers of one forward step: the patched model
    opens that step (:func:`moekit.ramp.select.step`) around its own forward, so its user does
    not have to."""
    from moekit.ramp.select import step

    scopes = []

    # A compiled forward has no step to open: its graphs read nothing on the host, and RaMP's
    # policies take the static choice there (moekit.ops.policy).
    def enter(module, args, kwargs):
        if torch.compiler.is_compiling():
            return
        scope = step()
        scope.__enter__()
        scopes.append(scope)

    def leave(module, args, kwargs, output):
        if scopes and not torch.compiler.is_compiling():
            scopes.pop().__exit__(None, None, None)

    return [model.register_forward_pre_hook(enter, with_kwargs=True),
            model.register_forward_hook(leave, with_kwargs=True, always_call=True)]


def unpatch(model: nn.Module) -> None:
    """Undo :func:`patch`: the model runs transformers' own experts again (ValueError if not patched)."""
    state = model.__dict__.get("_moekit_patch") if isinstance(model, nn.Module) else None
    if state is None:
        raise ValueError(f"{type(model).__name__} is not patched by moekit")
    for hook in state.hooks:
        hook.remove()
    for p in state.blocks:
        if p.method == "swap":
            swapped = p.block.experts
            # The parameters the model holds now (load_state_dict(..., assign=True) replaces them
            # on the swapped module) go back with the original module.
            if isinstance(swapped, MoekitExperts):
                p.original_experts.gate_up_proj = swapped.gate_up_proj
                p.original_experts.down_proj = swapped.down_proj
            p.block.experts = p.original_experts
        else:
            p.original_experts.__dict__.pop("_moekit_backend", None)
    for config, previous in zip(state.configs, state.previous or [None] * len(state.configs)):
        key = id(config)
        if _PREVIOUS_IMPLEMENTATION.get(key, (None,))[0] is not config:
            # A copy of a patched model (copy.deepcopy) has its own config, which no other model shares.
            config._experts_implementation_internal = previous
            continue
        _CONFIG_USERS[key] -= 1
        if _CONFIG_USERS[key] == 0:
            config._experts_implementation_internal = _PREVIOUS_IMPLEMENTATION.pop(key)[1]
            del _CONFIG_USERS[key]
    del model.__dict__["_moekit_patch"]


def is_patched(model: nn.Module) -> bool:
    return isinstance(model, nn.Module) and "_moekit_patch" in model.__dict__


def patched_blocks(model: nn.Module) -> list[PatchedBlock]:
    """The blocks :func:`patch` patched, in layer order (ValueError if not patched)."""
    state = model.__dict__.get("_moekit_patch") if isinstance(model, nn.Module) else None
    if state is None:
        raise ValueError(f"{type(model).__name__} is not patched by moekit: patch(model) first")
    return list(state.blocks)


def routing_taps(model: nn.Module) -> list[RoutingTap]:
    """One :class:`RoutingTap` per MoE block in layer order, for ``RoutingRecorder(routing_taps(model))``."""
    return [p.tap for p in patched_blocks(model)]


def num_routed_experts(model: nn.Module) -> int:
    """E, the routed experts per MoE block (the same in every block of the supported models)."""
    return _total_experts(moe_blocks(model)[0][1].experts)


# -------------------------------------------------------------------------- internals


def _total_experts(experts: nn.Module) -> int:
    """E of an experts module: its ``moekit_shard`` says so when it holds one rank's experts only
    (:func:`moekit.integrations.lm.build_expert_parallel`), else its stacked weights."""
    shard = getattr(experts, "moekit_shard", None)
    return int(shard.num_experts if shard is not None else experts.gate_up_proj.shape[0])


def _check_shard(name: str, experts: nn.Module, rank: int, world_size: int) -> None:
    """A module holding one rank's experts runs only under a dispatcher of that rank and world size."""
    shard = getattr(experts, "moekit_shard", None)
    if shard is None:
        return
    if (shard.rank, shard.world_size) != (rank, world_size):
        raise ValueError(f"the experts of {name or 'the model'} are rank {shard.rank}'s of {shard.world_size} "
                         f"(built for expert parallelism); the dispatcher is rank {rank} of {world_size}")
    if experts.gate_up_proj.shape[0] * world_size != shard.num_experts:
        raise ValueError(f"the experts of {name or 'the model'} hold {experts.gate_up_proj.shape[0]} experts; rank "
                         f"{rank} of {world_size} owns {shard.num_experts // world_size}")


def _top_k(block: nn.Module) -> int:
    gate = getattr(block, "gate", None)
    k = getattr(gate, "top_k", None) or getattr(block, "top_k", None)
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"cannot read top_k from the router of {type(block).__name__}")
    return k


def _check_experts_layout(name: str, block: nn.Module) -> None:
    """The experts must be stacked SwiGLU weights moekit's compute reads as they are."""
    ex = block.experts
    kind = f"{type(block).__name__} at {name or 'the model'}"
    w13, w2 = getattr(ex, "gate_up_proj", None), getattr(ex, "down_proj", None)
    if not isinstance(w13, torch.Tensor) or not isinstance(w2, torch.Tensor) or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"{kind}: experts must hold stacked gate_up_proj [E, 2N, H] and down_proj [E, H, N]")
    E, two_n, H = w13.shape
    if tuple(w2.shape) != (E, H, two_n // 2) or two_n % 2:
        raise ValueError(f"{kind}: gate_up_proj {tuple(w13.shape)} and down_proj {tuple(w2.shape)} are not "
                         "[E, 2N, H] and [E, H, N] (a transposed layout is not supported)")
    flags = {"has_bias": False, "is_transposed": False, "has_gate": True, "is_concatenated": True,
             "has_post_expert_norm": False}
    for flag, wanted in flags.items():
        if getattr(ex, flag, wanted) != wanted:
            raise ValueError(f"{kind}: experts with {flag}={not wanted} are not supported")
    act = getattr(ex, "act_fn", None)
    if type(act).__name__ not in ("SiLU", "SiLUActivation"):
        raise ValueError(f"{kind}: experts use {type(act).__name__}; moekit's experts are SwiGLU (SiLU gate)")


def _choose_method(block: nn.Module, method: str) -> str:
    pluggable = hasattr(type(block.experts).forward, "__wrapped__") and hasattr(block.experts, "config")
    if method == "interface" and not pluggable:
        raise ValueError(f"{type(block.experts).__name__} does not take part in transformers' experts "
                         "interface: use method='swap' (or 'auto')")
    if method == "auto":
        return "interface" if pluggable else "swap"
    return method


def _resolve_dispatcher(dispatcher, num_experts: int, hidden: int, top_k: int):
    if dispatcher is None:
        from moekit.moe.layer import default_dispatcher

        dispatcher = default_dispatcher(num_experts, hidden=hidden, top_k=top_k)
    if not callable(getattr(dispatcher, "dispatch", None)) or not callable(getattr(dispatcher, "combine", None)):
        raise ValueError(f"dispatcher must be a moekit Dispatcher (dispatch + combine), got {type(dispatcher).__name__}")
    E = getattr(dispatcher, "num_experts", num_experts)
    if E != num_experts:
        raise ValueError(f"dispatcher routes {E} experts; the model's blocks have num_experts={num_experts}")
    for name, model_value in (("hidden", hidden), ("top_k", top_k)):
        # The dispatchers keep the values they check each step's inputs against on themselves or
        # on their step check (the low-latency layer).
        given = getattr(dispatcher, name, None)
        if given is None:
            given = getattr(getattr(dispatcher, "step", None), name, None)
        if isinstance(given, int) and given != model_value:
            raise ValueError(f"the dispatcher was built for {name}={given}; the model's MoE blocks have "
                             f"{name}={model_value}")
    rank, world_size = int(getattr(dispatcher, "rank", 0)), int(getattr(dispatcher, "world_size", 1))
    if world_size < 1 or num_experts % world_size:
        raise ValueError(f"the dispatcher's world_size={world_size} must divide num_experts={num_experts}")
    return dispatcher, rank, world_size


def _apply(patched: list[PatchedBlock]) -> list[Any]:
    """Switch the blocks to moekit; the configs that now name the "moekit" implementation."""
    configs: dict[int, Any] = {}
    if any(p.method == "interface" for p in patched):
        _register_implementation()
    for p in patched:
        if p.method == "swap":
            p.block.experts = MoekitExperts(p.original_experts, p.backend)
            continue
        p.original_experts.__dict__["_moekit_backend"] = p.backend
        configs.setdefault(id(p.original_experts.config), p.original_experts.config)
    for key, config in configs.items():
        if key not in _PREVIOUS_IMPLEMENTATION:
            _PREVIOUS_IMPLEMENTATION[key] = (config, config._experts_implementation)
            _CONFIG_USERS[key] = 0
            # The internal attribute, not the property: the property also rewrites sub-configs.
            config._experts_implementation_internal = IMPLEMENTATION
        _CONFIG_USERS[key] += 1
    return list(configs.values())


def _register_implementation() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if ALL_EXPERTS_FUNCTIONS.get(IMPLEMENTATION) is not _moekit_experts_forward:
        type(ALL_EXPERTS_FUNCTIONS).register(IMPLEMENTATION, _moekit_experts_forward)
