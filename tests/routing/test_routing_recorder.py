"""RoutingRecorder against a small stand-in router with the TopKRouter forward contract."""

import numpy as np
import pytest
import torch

from moekit.routing import RoutingRecorder, RoutingTrace

H, E, K = 16, 8, 2


class StandInRouter(torch.nn.Module):
    """Linear gate + softmax + top-k, renormalized: forward(x[T, H]) -> (ids int64, weights float32)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int):
        super().__init__()
        self.gate = torch.nn.Linear(hidden, num_experts, bias=False)
        self.top_k = top_k

    def forward(self, x):
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        return ids, weights / weights.sum(dim=-1, keepdim=True)


class TinyMoEModel(torch.nn.Module):
    """Only the routing part of a few MoE layers; the hidden state is perturbed per layer."""

    def __init__(self, layers: int):
        super().__init__()
        torch.manual_seed(0)
        self.routers = torch.nn.ModuleList(StandInRouter(H, E, K) for _ in range(layers))

    def forward(self, x):
        outputs = []
        for i, router in enumerate(self.routers):
            outputs.append(router(x + i))
        return outputs


def test_records_every_layer_of_every_forward_with_padding():
    model = TinyMoEModel(layers=3)
    inputs = [torch.randn(T, H) for T in (5, 8, 3)]
    with RoutingRecorder(list(model.routers)) as rec:
        expected = [model(x) for x in inputs]
    trace = rec.to_trace(num_experts=E, name="tiny", metadata={"model": "tiny"})
    assert isinstance(trace, RoutingTrace)
    assert trace.topk_ids.shape == (3, 3, 8, K) and trace.topk_weights.shape == (3, 3, 8, K)
    for step, outputs in enumerate(expected):
        T = inputs[step].shape[0]
        for layer, (ids, weights) in enumerate(outputs):
            assert np.array_equal(trace.topk_ids[step, layer, :T], ids.numpy())
            assert torch.equal(torch.from_numpy(trace.topk_weights[step, layer, :T]), weights)
            assert (trace.topk_ids[step, layer, T:] == -1).all()
            assert (trace.topk_weights[step, layer, T:] == 0).all()
    assert trace.name == "tiny" and trace.metadata == {"model": "tiny"}


def test_detach_stops_recording_and_attach_resumes():
    model = TinyMoEModel(layers=2)
    rec = RoutingRecorder(list(model.routers)).attach()
    rec.attach()  # attaching twice must not double-record
    model(torch.randn(4, H))
    rec.detach()
    model(torch.randn(4, H))
    assert rec.num_steps == 1
    rec.attach()
    model(torch.randn(4, H))
    rec.detach()
    assert rec.num_steps == 2 and rec.to_trace(E).num_steps == 2


def test_manual_steps_concatenate_calls_of_a_step():
    router = StandInRouter(H, E, K)
    x1, x2, x3 = torch.randn(3, H), torch.randn(2, H), torch.randn(4, H)
    with RoutingRecorder(router, auto_step=False) as rec:  # a single module is accepted
        a, b = router(x1), router(x2)  # chunked prefill: two calls, one step
        rec.next_step()
        c = router(x3)
    trace = rec.to_trace(E, pad_multiple=4)
    assert trace.topk_ids.shape == (2, 1, 8, K)  # longest is 5 rows, padded up to 8
    assert np.array_equal(trace.topk_ids[0, 0, :5], torch.cat([a[0], b[0]]).numpy())
    assert np.array_equal(trace.topk_ids[1, 0, :4], c[0].numpy())
    assert (trace.topk_ids[0, 0, 5:] == -1).all()


def test_layer_that_did_not_run_is_masked():
    model = TinyMoEModel(layers=2)
    with RoutingRecorder(list(model.routers)) as rec:
        model(torch.randn(3, H))
        model.routers[0](torch.randn(3, H))  # a step where only layer 0 runs
    trace = rec.to_trace(E)
    assert trace.num_steps == 2
    assert (trace.topk_ids[1, 1] == -1).all() and (trace.topk_ids[1, 0] >= 0).all()


def test_recorded_copies_are_independent_of_later_changes():
    class BufferRouter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ids = torch.zeros(2, K, dtype=torch.int64)
            self.w = torch.full((2, K), 0.5)

        def forward(self, x):
            return self.ids, self.w

    router = BufferRouter()
    with RoutingRecorder(router) as rec:
        router(torch.randn(2, H))
        router.ids += 1  # the router reuses its output buffer in place
    assert (rec.to_trace(E).topk_ids == 0).all()


class FixedRouter(torch.nn.Module):
    """Returns a fixed output, whatever the input (for contract tests)."""

    def __init__(self, output):
        super().__init__()
        self.output = output

    def forward(self, x):
        return self.output


@pytest.mark.parametrize(
    "output, message",
    [
        (torch.zeros(2, K), "must return"),
        ((torch.zeros(2, K, dtype=torch.int64),), "must return"),
        ((torch.zeros(2, K), torch.zeros(2, K)), "integer tensor"),
        ((torch.zeros(2, K, dtype=torch.int64), torch.zeros(2, K + 1)), "shape"),
    ],
)
def test_router_contract_violation_raises_at_forward(output, message):
    router = FixedRouter(output)
    with RoutingRecorder(router):
        with pytest.raises(ValueError, match=message):
            router(torch.randn(2, H))


def test_constructor_and_to_trace_errors():
    with pytest.raises(ValueError, match="at least one"):
        RoutingRecorder([])
    router = StandInRouter(H, E, K)
    with pytest.raises(ValueError, match="same router twice"):
        RoutingRecorder([router, router])
    with pytest.raises(ValueError, match="nothing recorded"):
        RoutingRecorder(router).to_trace(E)
    with pytest.raises(ValueError, match="pad_multiple"):
        RoutingRecorder(router).to_trace(E, pad_multiple=0)


def test_to_trace_checks_ids_and_top_k():
    high = FixedRouter((torch.full((2, K), 7, dtype=torch.int64), torch.full((2, K), 0.5)))
    with RoutingRecorder(high) as rec:
        high(torch.randn(2, H))
    with pytest.raises(ValueError, match="num_experts"):
        rec.to_trace(num_experts=4)  # recorded id 7 does not exist among 4 experts
    one = FixedRouter((torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1)))
    two = FixedRouter((torch.zeros(2, 2, dtype=torch.int64), torch.ones(2, 2)))
    with RoutingRecorder([one, two]) as rec:
        one(torch.randn(2, H))
        two(torch.randn(2, H))
    with pytest.raises(ValueError, match="top_k"):
        rec.to_trace(E)
