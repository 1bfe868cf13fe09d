"""launch(): local spawn returns per-rank results; under torchrun it runs in place."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from moekit.ep import launch
from moekit.ep.group import free_port


def _rank_info(rank, world_size, tag):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return {"rank": rank, "world": world_size, "sum": t.item(), "tag": tag, "tensor": torch.arange(3) * rank}


def test_spawned_ranks_return_results_in_rank_order():
    results = launch(_rank_info, 3, "x", backend="gloo")
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["sum"] == 6.0 and r["world"] == 3 and r["tag"] == "x" for r in results)
    assert torch.equal(results[2]["tensor"], torch.tensor([0, 2, 4]))


def test_bad_world_size_and_timeout():
    with pytest.raises(ValueError, match="world_size"):
        launch(_rank_info, 0, "x")
    for bad in (0, -1.0, float("inf"), "5", None):
        with pytest.raises(ValueError, match="timeout"):
            launch(_rank_info, 2, "x", timeout=bad)


def _one_rank_raises(rank, world_size):
    if rank == 1:
        raise KeyError("no such expert")
    return rank


def test_a_rank_that_raises_fails_the_launch_with_its_traceback():
    """The others finish normally; the error names the rank, carries its traceback, and is
    still a torch ProcessRaisedException for callers that catch that."""
    import torch.multiprocessing as mp

    from moekit.ep import RankFailedError
    from tests.ep.deadline import hard_deadline

    with hard_deadline(240, "launch"), pytest.raises(RankFailedError) as info:
        launch(_one_rank_raises, 2, backend="gloo", timeout=30)
    error = info.value
    assert isinstance(error, mp.ProcessRaisedException) and error.error_index == 1
    assert error.failures == {1: "KeyError: 'no such expert'"} and error.results == [0, None]
    lines = str(error).strip().splitlines()
    assert lines[0] == "rank 1 raised:" and any("_one_rank_raises" in line for line in lines)
    assert lines[-1] == "launch: 1 of 2 ranks failed; rank 1: KeyError: 'no such expert'"


def test_under_torchrun(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import json, sys, torch, torch.distributed as dist
        from moekit.ep import launch

        def fn(rank, world_size):
            t = torch.tensor([float(rank)])
            dist.all_reduce(t)
            return {"rank": rank, "sum": t.item()}

        (result,) = launch(fn, 2)
        with open(sys.argv[1] + f"/rank{result['rank']}.json", "w") as f:
            json.dump(result, f)
    """))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(script), str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_cpu_env())
    assert done.returncode == 0, done.stderr[-2000:]
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {"rank": rank, "sum": 1.0}


def _cpu_env():
    import os

    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return env
