"""moekit.kernels.pdl: when kernels launch with programmatic dependent launch, and the zeroing
and cast kernels that stand in for torch's under it.

On CPU the two kernels run in Triton's interpreter without PDL (it has no griddepcontrol);
natively on a GPU (tests/kernels also runs there) they run as the library launches them. The
chains of the fused MoE kernels with PDL on and off are compared on the GPU
(tests/gpu/test_pdl_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moekit.kernels import LaunchPlan, pdl  # noqa: E402
from moekit.kernels.backend import interpreting  # noqa: E402
from moekit.kernels.occupancy import sm_count  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_off_on_cpu_in_the_interpreter_and_when_disabled():
    assert not pdl.pdl_on(torch.device("cpu"))
    if interpreting():
        assert not pdl.pdl_on(DEVICE)
    assert not pdl.pdl_on(DEVICE, LaunchPlan(pdl=False))
    assert pdl.launch_options(False) == {}
    assert pdl.launch_options(True) == {"launch_pdl": True}


def test_moekit_pdl_environment_variable():
    assert pdl.enabled_by({})
    for value in ("1", "on", "TRUE", " yes "):
        assert pdl.enabled_by({"MOEKIT_PDL": value})
    for value in ("0", "off", "False", "no"):
        assert not pdl.enabled_by({"MOEKIT_PDL": value})
    with pytest.raises(ValueError, match="MOEKIT_PDL"):
        pdl.enabled_by({"MOEKIT_PDL": "sometimes"})


def test_early_needs_pdl_its_role_and_one_program_per_sm():
    """A kernel lets its dependents launch at its start only under PDL, where the plan's
    pdl_early (by default pdl.EARLY) allows its role, and over at most one program per SM."""
    for role in pdl.EARLY:
        assert not pdl.early(role, False, 1, DEVICE)
    with pytest.raises(KeyError):
        pdl.early("no such kernel", True, 1, DEVICE)
    sms = sm_count(DEVICE)
    zero_early = LaunchPlan(pdl_early={"zero"})
    assert pdl.early("zero", True, 1, DEVICE, zero_early) and pdl.early("zero", True, sms, DEVICE, zero_early)
    assert not pdl.early("zero", True, sms + 1, DEVICE, zero_early)
    zero_late = LaunchPlan(pdl_early=set())
    assert not pdl.early("zero", True, 1, DEVICE, zero_late)
    assert not pdl.EARLY["gemm1"]  # GEMM2 follows GEMM1: no short kernel
    assert LaunchPlan().pdl_early == {role for role, on in pdl.EARLY.items() if on}


@pytest.mark.parametrize("n", [1, 1000, 1024, 2500])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int32])
def test_fill_zero_kernel_writes_zeros_up_to_n_only(n, dtype):
    """The zeroing kernel over a buffer of random values: [0, n) becomes 0, the rest (a tail
    that is not a whole block) is left as it was."""
    g = torch.Generator().manual_seed(n)
    buf = torch.randint(1, 1000, (n + 700,), generator=g).to(dtype).to(DEVICE)
    before = buf.clone()
    block = pdl._BLOCK
    on = pdl.pdl_on(DEVICE)
    grid = -(-n // block)
    pdl._fill_zero_kernel[(grid,)](buf, n, BLOCK=block, PDL=on, EARLY=pdl.early("zero", on, grid, DEVICE),
                                              **pdl.launch_options(on))
    assert torch.equal(buf[:n], torch.zeros(n, dtype=dtype, device=DEVICE))
    assert torch.equal(buf[n:], before[n:])


@pytest.mark.parametrize("n", [3, 1024, 3000])
def test_cast_kernel_equals_torch_cast(n):
    """float32 -> float16 (the interpreter's narrow type; bf16 is checked on the GPU) on random
    values spanning float16's range, rounding included: bit for bit torch's cast."""
    g = torch.Generator().manual_seed(n)
    src = (torch.randn(n, generator=g) * torch.logspace(-6, 4, n)).to(DEVICE)
    dst = torch.empty(n, dtype=torch.float16, device=DEVICE)
    on = pdl.pdl_on(DEVICE)
    pdl._cast_kernel[(-(-n // pdl._BLOCK),)](src, dst, n, BLOCK=pdl._BLOCK, PDL=on, **pdl.launch_options(on))
    assert torch.equal(dst, src.to(torch.float16))


def test_zeros_and_cast_helpers_equal_torch():
    z = pdl.zeros((5, 300), torch.float32, DEVICE)
    assert z.shape == (5, 300) and torch.equal(z, torch.zeros(5, 300, device=DEVICE))
    assert pdl.zeros((0,), torch.int32, DEVICE).numel() == 0
    src = torch.randn(7, 130, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    assert torch.equal(pdl.cast(src, torch.float16), src.to(torch.float16))
    assert pdl.cast(src, torch.float32) is src  # same dtype: no copy, as Tensor.to
