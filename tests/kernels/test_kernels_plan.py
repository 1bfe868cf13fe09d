"""moekit.kernels.plan: the LaunchPlan a caller passes, its checks, and the launch shapes derived
from it (host side: no kernel runs here)."""

from __future__ import annotations

import pytest
import torch

from moekit.kernels.plan import (DEFAULT_PLAN, PDL_ROLES, FixupPlan, LaunchPlan, check_plan, decode_column_tile,
                                 decode_gemm2_plan, fixup_plan)

CPU = torch.device("cpu")  # 132 SMs assumed off the GPU


@pytest.mark.parametrize("field, value", [
    ("decode_persistent", 1), ("persistent_ctas_per_sm", 0), ("persistent_max_splits", 0),
    ("decode_ctas_per_sm", -1), ("decode_w2_chunk_bytes", -1), ("decode_w2_chunk_bytes_fp8", 2.5),
    ("decode_smem_budget", 0), ("interpret_grid", 0), ("expert_major_ctas_per_sm", True),
    ("expert_major_interpret_grid", 0), ("pdl", "on"), ("fixup_fp8", (True, 4)),
])
def test_bad_fields_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"LaunchPlan.{field}"):
        LaunchPlan(**{field: value})


def test_pdl_early_roles_and_stamps_are_checked():
    with pytest.raises(ValueError, match="pdl_early"):
        LaunchPlan(pdl_early={"zero", "gemm3"})
    with pytest.raises(ValueError, match="pdl_early"):
        LaunchPlan(pdl_early="zero")
    assert LaunchPlan(pdl_early=["zero", "quant"]).pdl_early == frozenset({"zero", "quant"})
    assert LaunchPlan(pdl_early=PDL_ROLES).pdl_early == frozenset(PDL_ROLES)
    with pytest.raises(ValueError, match="stamps"):
        LaunchPlan(stamps=torch.zeros(8, dtype=torch.int32))


@pytest.mark.parametrize("blocks", [0, 3, 6, -4, 2.0])
def test_fixup_row_blocks_must_be_a_power_of_two(blocks):
    with pytest.raises(ValueError, match="row_blocks"):
        FixupPlan(shared=True, row_blocks=blocks)
    with pytest.raises(ValueError, match="shared"):
        FixupPlan(shared=1, row_blocks=4)


def test_plans_are_frozen_hashable_and_compare_without_stamps():
    plan = LaunchPlan(decode_persistent=False)
    with pytest.raises(AttributeError):
        plan.decode_persistent = True
    stamped = plan.replace(stamps=torch.zeros(16, dtype=torch.int64))
    assert stamped == plan and hash(stamped) == hash(plan) and stamped.stamps is not None
    assert plan != DEFAULT_PLAN and {plan: 1}[LaunchPlan(decode_persistent=False)] == 1
    assert plan.replace(decode_persistent=True) == DEFAULT_PLAN


def test_check_plan():
    assert check_plan(None) is DEFAULT_PLAN
    plan = LaunchPlan(interpret_grid=7)
    assert check_plan(plan) is plan
    with pytest.raises(ValueError, match="plan must be a moekit.kernels.LaunchPlan"):
        check_plan({"interpret_grid": 7})


def test_the_plan_decides_the_decode_gemm2_shape():
    """The decode GEMM2's column tile, chunk and splits follow the plan's fields: fewer CTAs per SM
    (no split; the 64-column tile once 32 would exceed them), other chunk targets and budgets."""
    args = (2048, 1024, 16, 128, 4, 2, 8, CPU)
    assert decode_gemm2_plan(*args) == (32, 256, 4)
    assert decode_gemm2_plan(*args, LaunchPlan(decode_ctas_per_sm=0)) == (64, 128, 1)  # 16 KB at 64 columns
    assert decode_column_tile(2048, CPU, LaunchPlan(decode_ctas_per_sm=0)) == 64
    assert decode_gemm2_plan(*args, LaunchPlan(decode_ctas_per_sm=4)) == (32, 128, 8)  # 48 KB a CTA: no wider
    assert decode_gemm2_plan(*args, LaunchPlan(decode_w2_chunk_bytes=0)) == (32, 128, 4)
    assert decode_gemm2_plan(*args, LaunchPlan(decode_w2_chunk_bytes=64 * 1024)) == (32, 256, 4)  # budget caps it
    assert decode_gemm2_plan(*args, LaunchPlan(decode_w2_chunk_bytes=64 * 1024,
                                               decode_smem_budget=1 << 20)) == (32, 1024, 4)
    fp8 = (2048, 1024, 16, 128, 3, 1, 8, CPU)
    assert decode_gemm2_plan(*fp8) == (32, 1024, 4)
    assert decode_gemm2_plan(*fp8, LaunchPlan(decode_w2_chunk_bytes_fp8=8 * 1024)) == (32, 256, 4)


def test_fixup_plan_follows_the_plan_per_precision():
    plan = LaunchPlan(fixup_fp8=FixupPlan(shared=False, row_blocks=2), fixup_16bit=FixupPlan(shared=True, row_blocks=8))
    assert fixup_plan(True, 16, interp=False, plan=plan) == (False, 2)
    assert fixup_plan(False, 16, interp=False, plan=plan) == (True, 8)
    assert fixup_plan(False, 16, interp=True, plan=plan) == (False, 8)  # the interpreter cannot wait
    assert fixup_plan(False, 4, interp=False, plan=plan) == (True, 4)  # never more blocks than rows
