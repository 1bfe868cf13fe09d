"""Fused MoE expert kernels (Triton): alignment, the configuration space, the kernels.

``fused_moe`` / ``fused_moe_expert_major`` need Triton; ``configs`` and ``align`` do not.
"""

from moekit.kernels.align import (Alignment, DirectBlocks, align_expert_major, align_tokens, direct_blocks,
                                  padded_capacity)
from moekit.kernels.configs import KernelConfig, config_space, default_config
from moekit.kernels.expert_major import expert_major_default, fused_moe_expert_major
from moekit.kernels.fused_moe import HAVE_TRITON, fused_moe

__all__ = [
    "Alignment", "DirectBlocks", "align_tokens", "direct_blocks", "align_expert_major", "padded_capacity",
    "KernelConfig", "config_space", "default_config",
    "HAVE_TRITON", "expert_major_default", "fused_moe", "fused_moe_expert_major",
]
