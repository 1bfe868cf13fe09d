"""The one-process path: MoELayer and a patched block use the local dispatcher (token-major, no
regrouping) by default, match the float64 reference, and read nothing back to the host."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

if not torch.cuda.is_available():  # the fused kernels run in Triton's interpreter here
    os.environ.setdefault("TRITON_INTERPRET", "1")

from moekit.ep.dispatcher import TOKEN_MAJOR  # noqa: E402
from moekit.ep.local import LocalDispatcher  # noqa: E402
from moekit.moe import MoELayer, MoEWeights, reference_moe  # noqa: E402
from moekit.shapes import MoEShape  # noqa: E402

SHAPE = MoEShape("tiny-shared", num_experts=8, top_k=3, hidden=48, intermediate=32, num_shared_experts=1,
                 shared_intermediate=16)


@contextlib.contextmanager
def no_host_reads():
    """Inside: any Tensor.item / tolist / cpu / numpy raises (a read back to the host)."""
    names = ("item", "tolist", "cpu", "numpy")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def refuse(name):
        def call(self, *args, **kwargs):
            raise AssertionError(f"host read: Tensor.{name}() in a forward step")
        return call

    for n in names:
        setattr(torch.Tensor, n, refuse(n))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


def test_no_host_reads_catches_one():
    with pytest.raises(AssertionError, match="host read"), no_host_reads():
        torch.ones(2).sum().item()


@pytest.mark.parametrize("experts", ["torch", "fused"])
def test_layer_defaults_to_the_local_dispatcher(experts):
    weights = MoEWeights.random(SHAPE, seed=3)
    layer = MoELayer(SHAPE, weights, experts=experts)
    assert isinstance(layer.dispatcher, LocalDispatcher)
    x = torch.randn(11, SHAPE.hidden, generator=torch.Generator().manual_seed(4))
    ids, w = layer.router(x)
    assert layer.dispatcher.dispatch(x, ids, w).layout == TOKEN_MAJOR
    with no_host_reads():
        y = layer(x, ids, w)
    want = reference_moe(x, weights.to(torch.float64), ids, w)
    rel = (y.double() - want).norm() / want.norm()
    assert rel < 1e-5, rel
    # The comparison has teeth: another routing moves the output by far more.
    assert (layer(x, ids.flip(1), w).double() - want).norm() / want.norm() > 1e-2


def test_torch_and_fused_agree_on_masked_slots():
    weights = MoEWeights.random(SHAPE, seed=5)
    x = torch.randn(9, SHAPE.hidden, generator=torch.Generator().manual_seed(6))
    layer = MoELayer(SHAPE, weights)
    ids, w = layer.router(x)
    ids = torch.where(torch.arange(9).unsqueeze(1) % 3 == 0, torch.full_like(ids, -1), ids)  # masked rows/slots
    ys = [MoELayer(SHAPE, weights, experts=e)(x, ids, w) for e in ("torch", "fused")]
    want = reference_moe(x, weights.to(torch.float64), ids, w)
    for y in ys:
        assert (y.double() - want).norm() / want.norm() < 1e-5


@pytest.mark.parametrize("experts", ["torch", "fused", "fused_fp8"])
def test_an_fp8_wire_reaches_every_experts_kind(experts):
    """The local dispatcher's FP8 wire (e4m3 tokens with group scales): the FP8 kernel takes them
    as they are, the others dequantize them first; all within FP8's error of float64."""
    from moekit.fp8 import calc_diff

    shape = MoEShape("fp8-wire", num_experts=4, top_k=2, hidden=128, intermediate=128)
    weights = MoEWeights.random(shape, seed=7)
    layer = MoELayer(shape, weights, dispatcher=LocalDispatcher(4, fp8=True), experts=experts)
    x = torch.randn(5, shape.hidden, generator=torch.Generator().manual_seed(8))
    ids, w = layer.router(x)
    y = layer(x, ids, w)
    want = reference_moe(x, weights.to(torch.float64), ids, w)
    assert calc_diff(y.double(), want) < 5e-3
