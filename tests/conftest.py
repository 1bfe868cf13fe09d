"""Shared fixtures of the whole suite."""

from __future__ import annotations

import os

import pytest

# Under pytest-xdist (the README's `-n 2`) the workers share the cores: one intra-op thread each,
# inherited by the ranks they launch (set before torch starts its thread pool).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

# Without a GPU every Triton kernel runs in the interpreter, and TRITON_INTERPRET is read when a
# kernel is decorated: set here, before any test module imports Triton or moekit's kernels, so
# the order in which modules are collected cannot decide it (tests/kernels/__init__.py sets it
# too, for its package alone). Tests of a CPU user's own environment strip it from their
# subprocesses (tests/kernels/test_kernels_backend.py, tests/docs).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.rank_pool import RankPool

pytest_plugins = ["pytester"]  # tests/test_rank_pool.py runs toy suites through the shared launch


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "ranks(job, world_size=None, deadline=900, timeout=300): a multi-rank test whose job "
        "(job(**params) -> (fn, *args)) runs in one gloo launch with the other marked tests of its "
        "world size; the pooled_launch fixture gives its per-rank results (tests/rank_pool.py)")


@pytest.fixture(scope="session")
def rank_pool():
    return RankPool()


@pytest.fixture
def pooled_launch(request, rank_pool):
    """``pooled_launch()``: the per-rank results of this test's ``@pytest.mark.ranks`` job, as
    ``launch`` would return them (see tests/rank_pool.py)."""
    if request.node.get_closest_marker("ranks") is None:
        pytest.fail(f"{request.node.nodeid} uses pooled_launch without @pytest.mark.ranks")
    return lambda: rank_pool.take(request.node)
