"""Profiling end to end in Triton's interpreter on a tiny shape, and its pieces."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import torch

from moekit.bench import ramp_profile as pf
from moekit.ramp.modelfile import load_model
from moekit.shapes import MoEShape


def test_resolve_shape_presets_shards_and_dimensions():
    s, routed = pf.resolve_shape("deepseek-v3-ep32")
    assert (s.num_experts, s.top_k, s.hidden, s.intermediate, routed) == (32, 8, 7168, 2048, 256)
    s, routed = pf.resolve_shape("deepseek-v3-tp8", hidden=64, intermediate=32)
    assert (s.num_experts, s.hidden, s.intermediate, routed) == (256, 64, 32, 256)
    s, routed = pf.resolve_shape(None, experts=6, top_k=2, hidden=128, intermediate=64, routed_experts=12)
    assert (s.num_experts, routed) == (6, 12)
    with pytest.raises(ValueError, match="missing: --hidden|hidden"):
        pf.resolve_shape(None, experts=6, top_k=2)
    with pytest.raises(ValueError, match="shape must be one of"):
        pf.resolve_shape("gpt-5")


def test_routing_is_cut_to_the_shard():
    shape = MoEShape("shard", num_experts=4, top_k=2, hidden=64, intermediate=32)
    r = pf.make_routing(shape, 16, pf.PointSpec(40, 0.7, None, 3))
    assert r.ids.shape == (40, 2) and int(r.ids.max()) < 4
    local = r.ids >= 0
    assert torch.equal(r.weights == 0, ~local)
    assert r.counts.tolist() == np.bincount(r.ids[local].numpy(), minlength=4).tolist()
    z = pf.make_routing(shape, 4, pf.PointSpec(40, None, 1.5, 3))
    assert z.counts.sum() == 80


def test_recorded_routing_is_used_as_given_and_cut_to_the_shard():
    shape = MoEShape("shard", num_experts=4, top_k=2, hidden=64, intermediate=32)
    rng = np.random.default_rng(7)
    ids = np.stack([rng.choice(16, 2, replace=False) for _ in range(12)])
    w = rng.random((12, 2)).astype(np.float32)
    r = pf.make_routing(shape, 16, pf.PointSpec(12, None, None, 0, "trace", ids=ids, weights=w))
    local = ids < 4
    assert torch.equal(r.ids, torch.from_numpy(np.where(local, ids, -1)))
    assert torch.equal(r.weights, torch.from_numpy(np.where(local, w, 0)))
    assert r.counts.tolist() == np.bincount(ids[local], minlength=4).tolist()
    u = pf.make_routing(shape, 16, pf.PointSpec(12, None, None, 0, "trace", ids=ids))
    assert torch.equal(u.weights, torch.where(u.ids >= 0, 0.5, 0.0))  # no weights recorded: 1 / K each
    with pytest.raises(ValueError, match=r"must be \[M=5, K\]"):
        pf.PointSpec(5, None, None, 0, "trace", ids=ids)
    with pytest.raises(ValueError, match="weights must come with its ids"):
        pf.PointSpec(12, None, None, 0, "trace", ids=ids, weights=w[:, :1])
    with pytest.raises(ValueError, match="the shape routes top-2 over 8 experts"):
        pf.make_routing(shape, 8, pf.PointSpec(12, None, None, 0, "trace", ids=ids))


def test_spec_validation():
    with pytest.raises(ValueError, match="family"):
        pf.ProfileSpec(shape="olmoe-1b-7b", family="x")
    with pytest.raises(ValueError, match="dtype must be bf16 or fp8"):
        pf.ProfileSpec(shape="olmoe-1b-7b", dtype="fp16")
    with pytest.raises(ValueError, match="betas"):
        pf.ProfileSpec(shape="olmoe-1b-7b", betas=(1.5,))
    with pytest.raises(ValueError, match="prune"):
        pf.ProfileSpec(shape="olmoe-1b-7b", prune=0.9)


# The token-family profile that two tests read (each profile times its configs in the interpreter: seconds).
TOKEN_SPEC = dict(experts=4, top_k=2, hidden=64, intermediate=32, m_values=(1, 12), betas=(1.0, 0.5), iters=1,
                  config_stride=25)


@pytest.fixture(scope="module")
def token_profile(tmp_path_factory):
    pytest.importorskip("triton")
    return pf.profile(pf.ProfileSpec(**TOKEN_SPEC), tmp_path_factory.mktemp("token-profile"), log=lambda s: None)


@pytest.mark.parametrize("family", ["token", "expert_major"])
def test_profile_writes_a_model_that_loads(tmp_path, family, request):
    pytest.importorskip("triton")
    if family == "token":
        rec = request.getfixturevalue("token_profile")
    else:
        spec = pf.ProfileSpec(**(TOKEN_SPEC | dict(family=family, capacity=8)))
        rec = pf.profile(spec, tmp_path, log=lambda s: None)
    shape = MoEShape("x", 4, 2, 64, 32)
    model, meta = load_model(rec["model_file"], shape=shape, dtype="bf16", family=family)
    t, tmeta = pf.load_timings(rec["timings_file"])
    assert tmeta["family"] == family and len(t.points) == 4 and len(t.configs) == len(model.configs)
    assert np.isfinite(t.times).all()  # every (config, point) ran and passed its check
    assert meta["profile"]["points"] == 4
    assert all(c.form == "two_launch" and c.split_k == 1 for c in model.configs) or family == "token"
    json.loads(open(rec["record"]).read())


def test_profile_resumes_the_token_counts_a_deadline_left(tmp_path):
    """A profile cut short keeps what it measured (the timings are saved after every token
    count); --resume keeps the token counts that file completed and times only the others."""
    pytest.importorskip("triton")
    spec = dict(experts=4, top_k=2, hidden=64, intermediate=32, m_values=(1, 12), betas=(1.0, 0.5), iters=1,
                config_stride=40)
    first = pf.profile(pf.ProfileSpec(**spec), tmp_path / "a", log=lambda s: None)
    t, meta = pf.load_timings(first["timings_file"])
    assert meta["params"]["complete_m"] == [1, 12]
    cut = [j for j, p in enumerate(t.points) if p.M == 12]
    t.times[cut[0], 1:] = np.nan  # as if the deadline came inside M = 12
    t.times[cut[1], 1:] = np.nan
    partial = pf.save_timings(t, tmp_path / "partial-timings.json.gz",
                              params={"profile": meta["params"]["profile"], "complete_m": [1]})
    lines = []
    rec = pf.profile(pf.ProfileSpec(**spec, resume=str(partial)), tmp_path / "b", log=lines.append)
    assert any("token counts [1] are measured there; timing [12]" in line for line in lines)
    t2, meta2 = pf.load_timings(rec["timings_file"])
    kept = [j for j, p in enumerate(t.points) if p.M == 1]
    assert np.array_equal(t2.times[kept], t.times[kept])  # kept, not timed again (host timings differ)
    assert np.isfinite(t2.times).all() and meta2["params"]["complete_m"] == [1, 12]
    assert rec["profile"]["resumed_from"] == str(partial)
    with pytest.raises(ValueError, match="routing differs"):
        pf.profile(pf.ProfileSpec(**spec, seed=3, resume=str(partial)), tmp_path / "c", log=lambda s: None)
    with pytest.raises(ValueError, match="configurations differ"):
        pf.profile(pf.ProfileSpec(**(spec | {"config_stride": 30}), resume=str(partial)), tmp_path / "d",
                   log=lambda s: None)


def test_timing_order_is_a_fixed_shuffle_of_the_whole_space():
    order = pf.timing_order(317)
    assert sorted(order) == list(range(317)) and order == pf.timing_order(317)
    assert order != list(range(317)) and pf.timing_order(317, seed=1) != order
    # The first sixth already reaches into every part of the space (bm-major: the last part is bm 128).
    assert {i * 4 // 317 for i in order[:53]} == {0, 1, 2, 3}


def test_timings_file_errors(tmp_path):
    bad = tmp_path / "t.json.gz"
    with gzip.open(bad, "wt") as f:
        f.write(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="not a moekit-ramp-timings"):
        pf.load_timings(bad)
    bad.write_text("plain")
    with pytest.raises(ValueError, match="not a gzip file"):
        pf.load_timings(bad)
    with gzip.open(bad, "wt") as f:
        f.write(json.dumps({"format": pf.TIMINGS_FORMAT, "version": pf.TIMINGS_VERSION, "shape": {}}))
    with pytest.raises(ValueError, match="malformed timings"):
        pf.load_timings(bad)


def test_prune_keeps_every_config_near_a_best():
    from moekit.ramp.dataset import Point, Timings
    from moekit.kernels.configs import KernelConfig

    shape = MoEShape("p", 4, 2, 64, 32)
    cfgs = [KernelConfig(bm=b) for b in (16, 32, 64, 128)]
    times = np.array([[10, 11, 30, 40], [20, 12, 14, 50]], dtype=float)
    t = Timings(shape, 4, "bfloat16", cfgs, [Point(1, 1, 1, np.ones(4, int)), Point(2, 1, 1, np.ones(4, int))], times)
    assert pf.prune_configs(t, 1.1) == [0, 1]
    assert pf.prune_configs(t, 1.2) == [0, 1, 2]


def test_shortlist_keeps_the_configs_near_a_best_and_those_never_measured():
    from moekit.ramp.dataset import Point, Timings
    from moekit.kernels.configs import KernelConfig

    shape = MoEShape("p", 4, 2, 64, 32)
    cfgs = [KernelConfig(bm=b) for b in (16, 32, 64, 128)]
    times = np.array([[10, 11, 30, np.nan], [20, 12, 14, np.nan]], dtype=float)
    ref = Timings(shape, 4, "bfloat16", cfgs, [Point(1, 1, 1, np.ones(4, int)), Point(2, 1, 1, np.ones(4, int))],
                  times)
    space = cfgs + [KernelConfig(bm=64, bn=64)]
    # bm=128 was never measured there and bm=64 bn=64 is not in it: both are timed, not dropped.
    assert pf.shortlist_configs(space, ref, 1.1) == [cfgs[0], cfgs[1], cfgs[3], space[4]]
    assert pf.shortlist_configs(space, ref, 1.2) == space
    # Several references: the union of their near-best configs; unmeasured means by none of them.
    other = Timings(shape, 4, "bfloat16", cfgs[2:], [Point(1, 1, 1, np.ones(4, int))], np.array([[5.0, 9.0]]))
    assert pf.shortlist_configs(space, [ref, other], 1.1) == [cfgs[0], cfgs[1], cfgs[2], space[4]]
    with pytest.raises(ValueError, match="factor must be > 1"):
        pf.shortlist_configs(space, ref, 1.0)
    with pytest.raises(ValueError, match="shortlist_factor"):
        pf.ProfileSpec(shape="olmoe-1b-7b", shortlist_factor=0.5)


def test_profile_times_only_the_shortlist_of_an_earlier_measurement(tmp_path, token_profile):
    spec = TOKEN_SPEC
    first = token_profile
    ref, _ = pf.load_timings(first["timings_file"])
    want = pf.shortlist_configs(ref.configs, ref, 1.05)
    assert 0 < len(want) < len(ref.configs)
    lines = []
    rec = pf.profile(pf.ProfileSpec(**spec, shortlist=first["timings_file"], shortlist_factor=1.05), tmp_path / "b",
                     log=lines.append)
    t, _ = pf.load_timings(rec["timings_file"])
    assert t.configs == want and np.isfinite(t.times).all()
    assert any(f"shortlist: {len(want)} of {len(ref.configs)} configs" in line for line in lines)
    assert rec["profile"]["space_configs"] == len(ref.configs) and rec["profile"]["timed_configs"] == len(want)
    with pytest.raises(ValueError, match="another shape"):
        pf.profile(pf.ProfileSpec(**(spec | {"hidden": 128}), shortlist=first["timings_file"]), tmp_path / "c",
                   log=lambda s: None)
    with pytest.raises(ValueError, match="another dtype or family"):
        pf.profile(pf.ProfileSpec(**spec, family="expert_major", shortlist=first["timings_file"]), tmp_path / "d",
                   log=lambda s: None)
    # Another shape's timings, asked for: its near-best configs that the new shape's space has.
    wide = pf.ProfileSpec(**(spec | {"hidden": 128}), shortlist=(first["timings_file"],), shortlist_factor=1.05,
                          shortlist_any_shape=True)
    space = pf.family_configs(pf.resolve_shape(experts=4, top_k=2, hidden=128, intermediate=32)[0], "bfloat16",
                              "token")[::25]
    rec = pf.profile(wide, tmp_path / "e", log=lambda s: None)
    t, _ = pf.load_timings(rec["timings_file"])
    assert t.configs == pf.shortlist_configs(space, ref, 1.05) and rec["profile"]["shortlist_any_shape"]
