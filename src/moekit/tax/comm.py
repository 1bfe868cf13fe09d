"""Communication volumes and times: AllToAll (EP) against AllReduce (TP), the MoE-tax paper, section 4.2.

Under TP both the MoE and its DenseFA twin AllReduce an m x d_model matrix after the
FFN, so TP has no communication tax. Under DP+EP, dispatch and combine are AllToAlls
whose buffer is m_g * K * d_model per GPU: K times the AllReduce input at the API level.

On the wire, a ring AllReduce moves 2(n-1)/n of its input per GPU, and an AllToAll
keeps the 1/n of assignments that target local experts off the network. The paper's
stated ratio K*n / (2(n-1)) (4.57 for DeepSeek-V3 on 8 GPUs) divides K by the ring
factor only; applying the local-expert discount to the AllToAll as well gives K/2.
``network_volumes`` computes both, so the choice is explicit.

Times follow an alpha-beta model: a message costs ``net_latency`` and each byte
1/``net_bw``. Per GPU, an AllToAll phase costs (n-1) messages plus
gamma * max(S_g, R_g) (the paper's T_a2a,g), and a ring AllReduce 2(n-1) steps.
"""

from __future__ import annotations

import numpy as np

from .hardware import Hardware
from .placement import Placement, assignment_gpus
from .topk import as_topk_array


def api_volume_ratio(top_k: int) -> float:
    """AllToAll dispatch buffer / AllReduce input for the same tokens per GPU: K."""
    return float(top_k)


def network_volume_ratio(top_k: int, n: int) -> float:
    """The paper's network-volume ratio K*n / (2(n-1)) (~4.6 for K=8, n=8)."""
    if n < 2:
        raise ValueError(f"n must be >= 2 for any traffic to cross the network, got {n}")
    return top_k * n / (2.0 * (n - 1))


def network_volumes(
    tokens_per_gpu: float, hidden: int, top_k: int, n: int, bytes_per_elem: float = 2.0,
    exclude_local: bool = False,
) -> dict:
    """Bytes one GPU puts on the network for one AllToAll phase and one ring AllReduce.

    Both collectives see the same ``tokens_per_gpu`` rows of ``hidden`` elements (the
    paper's API-level comparison). ``exclude_local=False`` reproduces the paper's ratio;
    True also drops the 1/n of assignments that stay on the GPU, giving K/2.
    """
    if n < 2:
        raise ValueError(f"n must be >= 2, got {n}")
    row = hidden * bytes_per_elem
    a2a_api = tokens_per_gpu * top_k * row
    a2a_net = a2a_api * ((n - 1) / n if exclude_local else 1.0)
    ar_api = tokens_per_gpu * row
    ar_net = ar_api * 2.0 * (n - 1) / n
    return {
        "alltoall_api": a2a_api,
        "alltoall_network": a2a_net,
        "allreduce_api": ar_api,
        "allreduce_network": ar_net,
        "api_ratio": a2a_api / ar_api if ar_api else float("nan"),
        "network_ratio": a2a_net / ar_net if ar_net else float("nan"),
    }


def gamma(hidden: int, bytes_per_elem: float, hw: Hardware) -> float:
    """Seconds to move one token's d_model-wide row over the network (the paper's gamma)."""
    return hidden * bytes_per_elem / hw.net_bw


def token_sources(num_tokens: int, n: int) -> np.ndarray:
    """The DP rank of each token: contiguous chunks, the first T % n ranks one larger."""
    sizes = num_tokens // n + (np.arange(n) < num_tokens % n)
    return np.repeat(np.arange(n), sizes)


def traffic(routing, placement: Placement, num_experts: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Remote token-expert assignments sent (S_g) and received (R_g^net) per GPU.

    Tokens are spread over the GPUs by ``token_sources`` (DP attention). Assignments to a
    local expert (replica) stay on the GPU and are not counted. Returns two ``[S, n]``
    arrays; for combine, sent and received swap roles.
    """
    ids, _ = as_topk_array(routing, num_experts if num_experts is not None else placement.num_experts)
    s, t, _ = ids.shape
    n = placement.n_gpus
    dst = assignment_gpus(ids, placement)
    src = np.broadcast_to(token_sources(t, n)[None, :, None], dst.shape)
    remote = (dst >= 0) & (dst != src)
    batch = np.broadcast_to(np.arange(s)[:, None, None], dst.shape)
    sent = np.bincount((batch * n + src)[remote], minlength=s * n).reshape(s, n)
    received = np.bincount((batch * n + dst)[remote], minlength=s * n).reshape(s, n)
    return sent, received


def alltoall_time(sent, received, gamma_s: float, hw: Hardware, n: int) -> np.ndarray:
    """T_a2a,g = (n-1) * latency + gamma * max(S_g, R_g), elementwise over GPUs.

    ``gamma_s`` is seconds per token row (``gamma(hidden, bytes, hw)``); for dispatch,
    pass (sent, received); for combine the roles swap but max() is the same.
    """
    sent = np.asarray(sent, dtype=np.float64)
    received = np.asarray(received, dtype=np.float64)
    latency = (n - 1) * hw.net_latency if n > 1 else 0.0
    return latency + gamma_s * np.maximum(sent, received)


def allreduce_time(num_tokens: float, hidden: int, bytes_per_elem: float, hw: Hardware, n: int) -> float:
    """Ring AllReduce of a num_tokens x hidden matrix: 2(n-1) steps, 2(n-1)/n of the bytes."""
    if n <= 1:
        return 0.0
    data = num_tokens * hidden * bytes_per_elem
    return 2 * (n - 1) * hw.net_latency + 2.0 * (n - 1) / n * data / hw.net_bw
