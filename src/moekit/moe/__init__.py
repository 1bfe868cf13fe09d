"""The MoE block: router, SwiGLU experts, the layer, and the single-process reference."""

from moekit.moe.experts import MoEWeights, SwiGLUExperts, expert_mlp, swiglu
from moekit.moe.fused_experts import FusedExperts
from moekit.moe.layer import EXPERT_KINDS, MoELayer
from moekit.moe.reference import reference_moe, reference_routing, reference_slot_sum
from moekit.moe.router import TopKRouter, softmax_topk

__all__ = [
    "EXPERT_KINDS", "FusedExperts", "MoELayer", "MoEWeights", "SwiGLUExperts", "TopKRouter", "expert_mlp",
    "reference_moe", "reference_routing", "reference_slot_sum", "softmax_topk", "swiglu",
]
