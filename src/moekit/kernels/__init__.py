"""Fused MoE expert kernels (Triton): alignment, the configuration space, the kernels.

``fused_moe`` / ``fused_moe_expert_major`` need Triton; ``configs``, ``align`` and ``plan`` do
not. A :class:`LaunchPlan` states how a call is launched (``plan=``); a :class:`KernelConfig`
what is compiled.
"""

from moekit.kernels.align import (Alignment, DirectBlocks, align_expert_major, align_tokens, direct_blocks,
                                  padded_capacity)
from moekit.kernels.backend import HAVE_TRITON
from moekit.kernels.configs import KernelConfig, config_space, default_config
from moekit.kernels.expert_major import expert_major_default, fused_moe_expert_major
from moekit.kernels.fused_moe import fused_moe
from moekit.kernels.plan import DEFAULT_PLAN, FixupPlan, LaunchPlan

__all__ = [
    "Alignment", "DirectBlocks", "align_tokens", "direct_blocks", "align_expert_major", "padded_capacity",
    "KernelConfig", "config_space", "default_config",
    "DEFAULT_PLAN", "FixupPlan", "LaunchPlan",
    "HAVE_TRITON", "expert_major_default", "fused_moe", "fused_moe_expert_major",
]
