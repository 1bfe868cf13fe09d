"""Record the routing of a real model through forward hooks on its router modules.

A router is any ``torch.nn.Module`` whose ``forward(x[T, H])`` returns
``(topk_ids [T, K] int64, topk_weights [T, K] float32)`` (``moekit.moe.router.TopKRouter``
follows this contract). The recorder keeps a CPU copy of every call, organised by step
and layer, and turns it into a :class:`~moekit.routing.trace.RoutingTrace`.

Recording copies to the host (a device sync per call), so it is a measurement tool: do
not use it inside CUDA-graph capture or on a latency-critical path.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch

from .trace import RoutingTrace


class RoutingRecorder:
    """Collect ``(topk_ids, topk_weights)`` from one router module per MoE layer.

    ``modules`` is a router module or a list of them, one per layer, in layer order.
    Use it as a context manager (``with RoutingRecorder(routers) as rec: model(x)``) or
    call :meth:`attach` / :meth:`detach`.

    Steps. With ``auto_step=True`` (default) a new step starts whenever a layer that has
    already been recorded in the current step is called again, which is what one forward
    pass of a model per step produces. With ``auto_step=False`` every call is appended to
    the current step (calls of the same layer are concatenated along tokens, e.g. for
    chunked prefill) until :meth:`next_step` is called.
    """

    def __init__(self, modules: torch.nn.Module | Iterable[torch.nn.Module], *, auto_step: bool = True):
        if isinstance(modules, torch.nn.Module):
            modules = [modules]
        self._modules = list(modules)
        if not self._modules:
            raise ValueError("modules must hold at least one router module")
        for i, m in enumerate(self._modules):
            if not isinstance(m, torch.nn.Module):
                raise ValueError(f"modules[{i}] must be a torch.nn.Module, got {type(m).__name__}")
        if len({id(m) for m in self._modules}) != len(self._modules):
            raise ValueError("modules must not contain the same router twice (one per layer)")
        self.auto_step = auto_step
        self._handles: list[Any] = []
        # _steps[s][layer] is the list of (ids, weights) calls of that layer in step s.
        self._steps: list[list[list[tuple[torch.Tensor, torch.Tensor]]]] = []
        self._open_step = False

    # -- lifecycle ------------------------------------------------------------------

    def attach(self) -> "RoutingRecorder":
        """Start recording (a no-op when already attached)."""
        if not self._handles:
            self._handles = [
                m.register_forward_hook(self._make_hook(layer)) for layer, m in enumerate(self._modules)
            ]
        return self

    def detach(self) -> None:
        """Stop recording; what was recorded is kept."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> "RoutingRecorder":
        return self.attach()

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    def next_step(self) -> None:
        """End the current step; the next router call starts a new one."""
        self._open_step = False

    def clear(self) -> None:
        """Forget everything recorded so far."""
        self._steps = []
        self._open_step = False

    @property
    def num_layers(self) -> int:
        return len(self._modules)

    @property
    def num_steps(self) -> int:
        return len(self._steps)

    # -- recording ------------------------------------------------------------------

    def _make_hook(self, layer: int):
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            self._record(layer, *_split_router_output(layer, output))

        return hook

    def _record(self, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        if self._open_step and self.auto_step and self._steps[-1][layer]:
            self._open_step = False  # this layer ran again: a new forward pass began
        if not self._open_step:
            self._steps.append([[] for _ in self._modules])
            self._open_step = True
        # Copies, so later in-place reuse of the router's output buffers cannot alter them.
        self._steps[-1][layer].append(
            (ids.detach().to("cpu", torch.int64, copy=True), weights.detach().to("cpu", torch.float32, copy=True))
        )

    # -- output ---------------------------------------------------------------------

    def to_trace(
        self, num_experts: int, *, name: str = "", metadata: dict | None = None, pad_multiple: int = 1
    ) -> RoutingTrace:
        """The recording as a :class:`RoutingTrace` ``[steps, layers, tokens, K]``.

        ``tokens`` is the largest token count of any (step, layer), rounded up to a
        multiple of ``pad_multiple`` (e.g. the world size, so ``peer_counts`` can split
        rows over ranks); shorter calls, and layers that did not run in a step, are padded
        with ``-1`` ids and 0 weights at the end.
        """
        if isinstance(pad_multiple, bool) or not isinstance(pad_multiple, int) or pad_multiple < 1:
            raise ValueError(f"pad_multiple must be an int >= 1, got {pad_multiple!r}")
        ks = {ids.shape[1] for step in self._steps for calls in step for ids, _ in calls}
        if len(ks) > 1:
            raise ValueError(f"recorded routers disagree on top_k: saw K in {sorted(ks)}")
        if not ks:
            raise ValueError("nothing recorded yet: run the model with the recorder attached")
        K = ks.pop()
        steps = [[_concat(calls) for calls in step] for step in self._steps]
        longest = max((ids.shape[0] for step in steps for ids, _ in step if ids is not None), default=0)
        T = -(-longest // pad_multiple) * pad_multiple
        topk_ids = np.full((len(steps), self.num_layers, T, K), -1, dtype=np.int64)
        topk_weights = np.zeros(topk_ids.shape, dtype=np.float32)
        for s, step in enumerate(steps):
            for layer, (ids, weights) in enumerate(step):
                if ids is not None:
                    topk_ids[s, layer, : ids.shape[0]] = ids.numpy()
                    topk_weights[s, layer, : ids.shape[0]] = weights.numpy()
        return RoutingTrace(
            topk_ids=topk_ids, num_experts=num_experts, topk_weights=topk_weights,
            name=name, metadata=dict(metadata or {}),
        )


_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)


def _split_router_output(layer: int, output: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Check a router's output against the contract and return (ids, weights)."""
    if not isinstance(output, (tuple, list)) or len(output) < 2:
        raise ValueError(
            f"router of layer {layer} must return (topk_ids, topk_weights), got {type(output).__name__}"
        )
    ids, weights = output[0], output[1]
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.dtype not in _INT_DTYPES:
        raise ValueError(f"router of layer {layer}: topk_ids must be an integer tensor [T, K], got {_describe(ids)}")
    if not isinstance(weights, torch.Tensor) or weights.shape != ids.shape:
        raise ValueError(
            f"router of layer {layer}: topk_weights must be a tensor of shape {tuple(ids.shape)}, "
            f"got {_describe(weights)}"
        )
    return ids, weights


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__


def _concat(calls: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """All calls of one layer in one step, concatenated along tokens (None if it never ran)."""
    if not calls:
        return None, None
    return torch.cat([ids for ids, _ in calls]), torch.cat([w for _, w in calls])
