"""The shared launch of tests/rank_pool.py: each test still gets only its own job's results, a
job that fails is reported by its own test (the others pass on their own), and ``-k`` selects
which jobs the shared launch runs. One-rank launches: the cheapest that go through it all."""

from __future__ import annotations

import pytest

TOY = '''
import pytest


def _plus_rank(rank, world_size, value):
    return value + rank


def _fails(rank, world_size):
    raise ValueError("the toy job fails")


@pytest.mark.ranks(lambda value: (_plus_rank, value), world_size=1, deadline=120, timeout=60)
@pytest.mark.parametrize("value", [10, 20])
def test_ok(value, pooled_launch):
    assert pooled_launch() == [value]


@pytest.mark.ranks(lambda: (_fails,), world_size=1, deadline=120, timeout=60)
def test_fails(pooled_launch):
    pooled_launch()
'''


@pytest.fixture
def toy(pytester, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # the toy suite runs as a plain session
    pytester.makeconftest("from tests.conftest import pooled_launch, pytest_configure, rank_pool  # noqa: F401\n")
    pytester.makepyfile(test_rank_pool_toy=TOY)
    return pytester


def test_a_failing_job_fails_its_own_test_only(toy):
    result = toy.runpytest_inprocess("-p", "no:cacheprovider", "-W", "always")
    result.assert_outcomes(passed=2, failed=1)
    out = result.stdout.str()
    assert "FAILED test_rank_pool_toy.py::test_fails" in out
    assert "the toy job fails" in out
    assert "the shared 1-rank launch failed; each test runs its own" in out


def test_k_selects_the_jobs_of_the_shared_launch(toy):
    result = toy.runpytest_inprocess("-p", "no:cacheprovider", "-W", "always", "-k", "test_ok")
    result.assert_outcomes(passed=2, deselected=1)
    assert "launch failed" not in result.stdout.str()  # the failing job was not in it
