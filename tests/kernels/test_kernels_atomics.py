"""moekit.kernels.atomics: adding float32 tiles into memory with atomics.

On CPU ``add_tile`` runs in Triton's interpreter, scalar (the four-wide instruction is inline
PTX); natively on a Hopper GPU (tests/kernels also runs there) both ways are checked, and
:func:`vector_on` must choose the four-wide one exactly where it is safe.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from moekit.kernels import atomics  # noqa: E402
from moekit.kernels.atomics import add_tile  # noqa: E402
from moekit.kernels.quant import interpreting  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HOPPER = DEVICE.type == "cuda" and torch.cuda.get_device_capability() >= (9, 0) and not interpreting()


@triton.jit
def _add_tiles_kernel(out_ptr, vals_ptr, rows_ptr, ok_ptr, stride_om, H, chunks,
                      BM: tl.constexpr, BK: tl.constexpr, VECTOR: tl.constexpr):
    """Program p adds tile vals[p] ([BM, BK]) into out at rows rows[p], columns from
    (p % chunks) * BK, the rows where ok[p] and the columns before H."""
    p = tl.program_id(0)
    r = tl.arange(0, BM)
    c = tl.arange(0, BK)
    vals = tl.load(vals_ptr + p * BM * BK + r[:, None] * BK + c[None, :])
    rows = tl.load(rows_ptr + p * BM + r)
    ok = tl.load(ok_ptr + p * BM + r) != 0
    col0 = (p % chunks) * BK
    add_tile(out_ptr, rows, stride_om, col0, vals, ok, H - col0, BM, BK, VECTOR)


def _case(seed: int, H: int, rows_out: int = 10, programs: int = 24, BM: int = 16, BK: int = 32):
    """Random tiles, rows (repeated across programs, so addresses receive several adds), row
    masks, and a random starting output."""
    g = torch.Generator().manual_seed(seed)
    chunks = -(-H // BK)
    vals = torch.randn(programs, BM, BK, generator=g)
    rows = torch.randint(0, rows_out, (programs, BM), generator=g, dtype=torch.int32)
    ok = (torch.rand(programs, BM, generator=g) < 0.7).to(torch.int32)
    out0 = torch.randn(rows_out, H, generator=g)
    # The float64 reference, with the masks the kernel must keep.
    ref = out0.double().clone()
    for p in range(programs):
        col0 = (p % chunks) * BK
        width = min(BK, H - col0)
        for i in range(BM):
            if ok[p, i]:
                ref[rows[p, i], col0:col0 + width] += vals[p, i, :width].double()
    touched = torch.zeros(rows_out, H, dtype=torch.bool)
    for p in range(programs):
        col0 = (p % chunks) * BK
        touched[rows[p][ok[p] != 0].long(), col0:col0 + BK] = True
    return vals, rows, ok, out0, ref, touched, chunks


def _run(vals, rows, ok, out0, chunks, vector: bool, BM: int = 16, BK: int = 32):
    out = out0.to(DEVICE).clone()
    _add_tiles_kernel[(vals.shape[0],)](out, vals.to(DEVICE), rows.to(DEVICE), ok.to(DEVICE), out.stride(0),
                                        out.shape[1], chunks, BM=BM, BK=BK, VECTOR=vector)
    return out.cpu()


@pytest.mark.parametrize("H", [96, 104])  # whole chunks; a last chunk of 8 columns
@pytest.mark.parametrize("vector", [False, True], ids=["scalar", "v4"])
def test_add_tile_matches_float64_and_leaves_the_rest(H, vector):
    if vector and not HOPPER:
        pytest.skip("the four-wide atomic is inline PTX for sm_90+")
    vals, rows, ok, out0, ref, touched, chunks = _case(H, H)
    out = _run(vals, rows, ok, out0, chunks, vector)
    assert torch.equal(out[~touched], out0[~touched])  # nothing outside the masked tiles changed
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-6, err


def test_vector_on_only_where_safe(monkeypatch):
    assert not atomics.vector_on(torch.zeros(4, 8), torch.device("cpu"))
    if not HOPPER:
        assert not atomics.vector_on(torch.zeros(4, 8, device=DEVICE), DEVICE)
        return
    out = torch.zeros(4, 64, device=DEVICE)
    assert atomics.vector_on(out, DEVICE)
    assert not atomics.vector_on(torch.zeros(4, 66, device=DEVICE), DEVICE)  # rows not in groups of 4
    assert not atomics.vector_on(out[:, 1:61], DEVICE)  # groups not 16-byte aligned
    assert not atomics.vector_on(out.half(), DEVICE)
    monkeypatch.setattr(atomics, "ENABLED", False)
    assert not atomics.vector_on(out, DEVICE)
