"""A transformers MoE model served with expert parallelism: one rank's share, built and patched.

::

    # under torchrun (or inside moekit.ep.launch): one process per GPU
    from moekit.integrations.lm import build_expert_parallel

    model = build_expert_parallel("qwen3-30b-a3b", experts="fused", dtype=torch.bfloat16, device="cuda")
    out = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)

Each rank holds the attention, the routers, the norms, the embeddings and the head (replicated:
every rank runs its own batch through them, data parallel) and only its own experts,
``rank * E / P ... (rank + 1) * E / P - 1``. The MoE blocks are patched
(:func:`moekit.integrations.transformers.patch`) with an
:class:`~moekit.ep.AllToAllDispatcher` over the process group, which sends each (token, slot) to
the rank of its expert, receives expert-major rows ``[E_local, capacity, H]`` there, runs the
local experts on them (:func:`moekit.ep.dispatcher.run_experts`) and sends the results back to be
summed in the documented combine order.

The weights are random at the model's real dimensions, drawn per tensor and per expert
(:mod:`.seeded`): each rank draws its own experts directly, and the single-process model built
with the same recipe (:func:`seeded_model` with ``world_size=1``) has the same weights, so the
ranks generate the tokens that model generates.

Every rank must run the MoE blocks the same number of times: generate exactly
``max_new_tokens`` tokens (``min_new_tokens`` equal to it) on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moekit.integrations.lm.seeded import seeded_model


def group_rank_and_size(group=None) -> tuple[int, int]:
    """(rank, world size) in ``group`` (the default group), or (0, 1) with no process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    if group is not None:
        raise ValueError("a process group was given but torch.distributed is not initialized")
    return 0, 1


def build_expert_parallel(preset_or_config, *, layers: int | None = None, experts: str = "torch",
                          dtype=torch.bfloat16, device=None, seed: int = 0, group=None,
                          combine_order: str = "slot", kernel_config=None, dispatcher=None):
    """This rank's share of a model (see the module docstring), patched with an all-to-all
    dispatcher over ``group`` (default: the default process group). Returns the model.

    ``preset_or_config``: a preset name (:mod:`.presets`) or a transformers config.
    ``experts``: ``"torch"``, ``"fused"`` or ``"fused_fp8"`` (:func:`~moekit.integrations.transformers.patch`).
    ``device``: default ``cuda`` (the current device) when CUDA is available, else ``cpu``.
    ``dispatcher``: a dispatcher of this group to use instead of the default
    ``AllToAllDispatcher(E, group=group, hidden=H, top_k=K, combine_order=combine_order)``.
    Without a process group (or with a group of one) this is the whole model on one process with
    the local dispatcher.
    """
    from moekit.integrations.transformers import _top_k, moe_blocks, patch

    rank, world_size = group_rank_and_size(group)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    model = seeded_model(preset_or_config, layers=layers, dtype=dtype, device=device, seed=seed,
                         rank=rank, world_size=world_size)
    if dispatcher is None and world_size > 1:
        from moekit.ep import AllToAllDispatcher

        block = moe_blocks(model)[0][1]
        E = block.experts.moekit_shard.num_experts
        dispatcher = AllToAllDispatcher(E, group=group, hidden=int(block.experts.gate_up_proj.shape[2]),
                                        top_k=_top_k(block), combine_order=combine_order)
    patch(model, experts=experts, dispatcher=dispatcher, kernel_config=kernel_config)
    return model


def local_expert_count(model) -> int:
    """Experts held by this process in each MoE block (the same in every block)."""
    from moekit.integrations.transformers import moe_blocks

    counts = {int(b.experts.gate_up_proj.shape[0]) for _, b in moe_blocks(model)}
    if len(counts) != 1:
        raise ValueError(f"the MoE blocks hold different expert counts: {sorted(counts)}")
    return counts.pop()


def generate_tokens(model, ids: torch.Tensor, new_tokens: int, *, pad_token_id: int = 0,
                    compiled: bool = False, compile_options: dict | None = None) -> torch.Tensor:
    """Exactly ``new_tokens`` greedy tokens after ``ids`` (no early stop, so every rank runs the
    same number of steps). ``compiled``: a static cache and ``torch.compile`` of the decoding
    forward with ``compile_options`` (transformers' ``CompileConfig`` fields)."""
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  do_sample=False, pad_token_id=pad_token_id)
    if compiled:
        from transformers import CompileConfig

        kwargs.update(cache_implementation="static", compile_config=CompileConfig(**(compile_options or {})))
    with torch.no_grad():
        out = model.generate(ids, **kwargs)
    return out[:, ids.shape[1]:]
