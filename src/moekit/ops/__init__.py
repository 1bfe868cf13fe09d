"""The fused-MoE operations above the kernels: the configuration policy and the entries that use it.

* :mod:`moekit.ops.policy` -- which :class:`~moekit.kernels.KernelConfig` a call runs (the
  static choice per token-count bucket by default; RaMP's ``"ramp"`` / ``"auto"`` on request).
* :func:`fused_moe` / :func:`fused_moe_expert_major` -- the kernels with that policy; under
  ``torch.compile`` the custom operators ``torch.ops.moekit.fused_moe`` /
  ``torch.ops.moekit.fused_moe_expert_major`` (:mod:`moekit.ops.library`, registered when this
  package is imported; the kernels themselves are imported at the first call).
"""

from moekit.ops import library  # noqa: F401  (registers torch.ops.moekit.*)
from moekit.ops.calls import fused_moe, fused_moe_expert_major
from moekit.ops.policy import POLICIES, check_policy, forget_static, static_config, token_bucket

__all__ = ["POLICIES", "check_policy", "forget_static", "fused_moe", "fused_moe_expert_major", "static_config",
           "token_bucket"]
