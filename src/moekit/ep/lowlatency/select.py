"""When the low-latency layer applies: what ``moekit.moe.layer.default_dispatcher`` asks
before it picks :class:`~moekit.ep.lowlatency.EPLowLatencyAllToAll` over the eager
all-to-all.

Two questions. :func:`lowlatency_limits` (pure, the same answer on every rank): does the
shape fit the layer — a bound on the tokens a rank sends per call (its buffers are sized by
it), top-k, dtype, experts divisible by the ranks, at most ``MAX_PEERS`` ranks.
:func:`lowlatency_available` (a collective): can this group run its GPU transport — CUDA
tensors on an NCCL group, torch symmetric memory, every rank in one node with peer access
to the others (NVLink). Each rank checks itself and the group agrees (an all-reduce of the
answers), so every rank picks the same dispatcher.
"""

from __future__ import annotations

import importlib
import os

import torch
import torch.distributed as dist

from moekit.ep.lowlatency.layout import MAX_TOPK, SUPPORTED_DTYPES

MAX_PEERS = 8  # the GPU transport's peers are kernel arguments P0..P7 (one NVLink domain)


def lowlatency_limits(*, world_size: int, num_experts: int, hidden: int | None, top_k: int | None,
                      max_tokens: int | None, dtype: torch.dtype | None) -> str | None:
    """Why the shape does not fit the low-latency layer, or None when it does."""
    if max_tokens is None:
        return "no max_tokens: the low-latency layer sizes its buffers by the most tokens a rank sends per call"
    if not isinstance(max_tokens, int) or max_tokens < 1:
        return f"max_tokens must be an int >= 1, got {max_tokens!r}"
    if hidden is None or top_k is None:
        return "the low-latency layer needs hidden and top_k"
    if not 1 <= top_k <= MAX_TOPK:
        return f"top_k={top_k} is outside [1, {MAX_TOPK}]"
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} is not one of {[str(d) for d in SUPPORTED_DTYPES]}"
    if not 2 <= world_size <= MAX_PEERS:
        return f"world_size={world_size}: the low-latency layer runs on 2 to {MAX_PEERS} ranks of one node"
    if num_experts % world_size or top_k > num_experts:
        return f"num_experts={num_experts} must be a multiple of world_size={world_size} and >= top_k={top_k}"
    return None


def _local_capable(group) -> bool:
    """This rank alone: CUDA, an NCCL group, symmetric memory, one node, peer access."""
    if not torch.cuda.is_available() or "nccl" not in str(dist.get_backend(group)):
        return False
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError:
        return False
    world = dist.get_world_size(group)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    count = torch.cuda.device_count()
    if local != world or count < world:
        return False  # ranks on several nodes, or fewer GPUs here than ranks
    me = torch.cuda.current_device()
    return all(torch.cuda.can_device_access_peer(me, d) for d in range(count) if d != me)


def lowlatency_available(group=None) -> bool:
    """Whether every rank of ``group`` (default: the default group) can run the GPU transport;
    the same answer on every rank. A collective on an initialized group of several ranks."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
        return False
    ok = _local_capable(group)
    backend = str(dist.get_backend(group))
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
