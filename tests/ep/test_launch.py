"""launch(): local spawn returns per-rank results; under torchrun it runs in place."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

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


def _environment_and_parent(rank, world_size, names):
    return {name: os.environ.get(name) for name in names}, os.getppid()


_ENVIRONMENT_LAUNCHER = textwrap.dedent("""
    import json, os
    from moekit.ep import launch
    from tests.ep.test_launch import _environment_and_parent

    names = ["MOEKIT_LAUNCH_TEST", "LAUNCH_TEST_PLAIN"]
    out = {"me": os.getpid(), "runs": []}
    out["runs"].append(launch(_environment_and_parent, 2, names, backend="gloo"))
    os.environ["LAUNCH_TEST_PLAIN"] = "plain"
    out["runs"].append(launch(_environment_and_parent, 2, names, backend="gloo"))
    os.environ["MOEKIT_LAUNCH_TEST"] = "import-time"
    out["runs"].append(launch(_environment_and_parent, 2, names, backend="gloo"))
    print(json.dumps(out))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is used on Linux")
def test_gloo_ranks_start_from_the_fork_server_with_the_launchers_environment():
    """gloo ranks are forked from the fork server (not spawned by the launcher), and each launch's
    ranks see the launcher's environment as it is then: a plain variable set after the server
    started is there, and one of the kinds read at import time spawns the ranks instead."""
    env = {k: v for k, v in _cpu_env().items() if k not in ("MOEKIT_LAUNCH_TEST", "LAUNCH_TEST_PLAIN")}
    done = subprocess.run([sys.executable, "-c", _ENVIRONMENT_LAUNCHER], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    (first, served, spawned), me = out["runs"], out["me"]
    assert [e for e, _ in first] == [{"MOEKIT_LAUNCH_TEST": None, "LAUNCH_TEST_PLAIN": None}] * 2
    assert all(parent != me for _, parent in first), "ranks were not forked from the fork server"
    assert [e for e, _ in served] == [{"MOEKIT_LAUNCH_TEST": None, "LAUNCH_TEST_PLAIN": "plain"}] * 2
    assert all(parent != me for _, parent in served)
    assert [e for e, _ in spawned] == [{"MOEKIT_LAUNCH_TEST": "import-time", "LAUNCH_TEST_PLAIN": "plain"}] * 2
    assert all(parent == me for _, parent in spawned), "an import-time variable changed: the ranks are spawned"


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


def _sleeping_rank(rank, world_size, folder):
    """Say who this rank is, then sleep far longer than any test."""
    Path(folder, f"rank{rank}.pid").write_text(str(os.getpid()))
    time.sleep(600)


_LAUNCHER = textwrap.dedent("""
    import sys
    from moekit.ep import launch
    from tests.ep.test_launch import _sleeping_rank

    launch(_sleeping_rank, 2, sys.argv[1], backend="gloo", timeout=600)
""")


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for a reaper that may never come does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_ranks_end_with_their_launcher(tmp_path, how):
    """A launcher killed with SIGTERM stops its ranks before it goes (and still dies of
    SIGTERM); one killed with SIGKILL runs no code at all, and its ranks go by themselves."""
    root = Path(__file__).resolve().parents[2]
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(tmp_path)], cwd=root, env=_cpu_env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 240  # spawning two ranks that import torch on a loaded machine
        while len(pids) < 2:
            assert launcher.poll() is None, f"the launcher ended early: {launcher.stderr.read()[-2000:]!r}"
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.2)
            pids = [int(p.read_text()) for p in sorted(tmp_path.glob("rank*.pid")) if p.read_text()]
        launcher.send_signal(how)
        assert launcher.wait(timeout=60) == -how
        gone_by = time.monotonic() + 10
        while any(_alive(pid) for pid in pids) and time.monotonic() < gone_by:
            time.sleep(0.1)
        assert [pid for pid in pids if _alive(pid)] == [], f"ranks still running 10 s after {how.name}"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in pids:  # this test's own ranks, should they have outlived it
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_the_parent_watch_ends_a_rank_without_prctl(tmp_path):
    """The polling thread alone (no PR_SET_PDEATHSIG) ends a rank whose parent is gone."""
    pid_file = tmp_path / "child.pid"
    script = tmp_path / "orphan.py"
    script.write_text(textwrap.dedent("""
        import os, signal, subprocess, sys, time
        if sys.argv[1] == "child":
            import moekit.ep.group as group
            group.sys.platform = "elsewhere"  # as where prctl is missing: only the watching thread
            group._die_with_parent(int(sys.argv[3]))
            open(sys.argv[2], "w").write(str(os.getpid()))
            time.sleep(600)
        else:
            subprocess.Popen([sys.executable, __file__, "child", sys.argv[2], str(os.getpid())])
            while not os.path.exists(sys.argv[2]) or not open(sys.argv[2]).read():
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)  # the parent goes without a word
    """))
    parent = subprocess.run([sys.executable, str(script), "parent", str(pid_file)], env=_cpu_env(), timeout=120)
    assert parent.returncode == -signal.SIGKILL
    pid = int(pid_file.read_text())
    try:
        gone_by = time.monotonic() + 5
        while _alive(pid) and time.monotonic() < gone_by:
            time.sleep(0.05)
        assert not _alive(pid), "the child outlived its parent by 5 s"
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
