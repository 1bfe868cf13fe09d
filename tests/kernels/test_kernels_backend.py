"""moekit.kernels.backend: what a caller without a GPU gets (a working interpreter run with one
note, or one clear error), and the interpreter's masks from scalar conditions (which Triton's
interpreter from 3.7 on rejects unless they reach it as bool)."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SRC = str(Path(__file__).resolve().parents[2] / "src")


@triton.jit
def _masked_copy(src_ptr, dst_ptr, n, limit, BLOCK: tl.constexpr):
    """dst[i] = src[i] where program 0 runs (a scalar condition as the whole mask) and, for
    program 1, where i < n and the scalar ``limit > 0`` holds (a block mask and a scalar one)."""
    offs = tl.arange(0, BLOCK)
    pid = tl.program_id(0)
    if pid == 0:
        live = n > 2  # a scalar comparison, broadcast to the block as the mask
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=live, other=-1.0), mask=live)
    else:
        ok = (offs < n) & (limit > 0)
        tl.store(dst_ptr + BLOCK + offs, tl.load(src_ptr + BLOCK + offs, mask=ok, other=-1.0), mask=ok)


@pytest.mark.parametrize("n, limit", [(5, 1), (2, 1), (5, 0)])
def test_scalar_conditions_as_masks(n, limit):
    src = torch.arange(1, 33, dtype=torch.float32, device=DEVICE)
    dst = torch.full((32,), 7.0, device=DEVICE)
    _masked_copy[(2,)](src, dst, n, limit, BLOCK=16)
    want = torch.full((32,), 7.0)
    if n > 2:
        want[:16] = src[:16].cpu()
    if limit > 0:
        want[16:16 + n] = src[16:16 + n].cpu()
    assert torch.equal(dst.cpu(), want)


_CPU_USER = """
import os, sys, warnings, torch
warnings.simplefilter("always")
from moekit.kernels import KernelConfig, fused_moe
from moekit.moe.experts import MoEWeights
from moekit.moe.reference import reference_moe
from moekit.routing.generate import synthetic_routing
from moekit.shapes import MoEShape
print("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET"))
shape = MoEShape("tiny", num_experts=4, top_k=2, hidden=48, intermediate=40)
w = MoEWeights.random(shape, seed=1, dtype=torch.float32)
x = torch.randn(3, shape.hidden, generator=torch.Generator().manual_seed(2))
ids, tw = synthetic_routing(3, shape.num_experts, shape.top_k, seed=3)
ref = reference_moe(x.double(), MoEWeights(w.router, w.w13.double(), w.w2.double()), ids, tw)
for _ in range(2):
    try:
        y = fused_moe(x, w.w13, w.w2, ids, tw, KernelConfig(bm=16, bn=16, bk=16, form="fused"))
    except ValueError as error:
        print("ERROR", error)
        sys.exit(3)
    print("relerr", ((y.double() - ref).norm() / ref.norm()).item())
"""


def _run_as_cpu_user(env_changes: dict, prelude: str = "") -> subprocess.CompletedProcess:
    """The script above in a fresh process without a visible GPU and without TRITON_INTERPRET
    (unless ``env_changes`` sets it)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=SRC + os.pathsep + env.get("PYTHONPATH", ""), **env_changes)
    return subprocess.run([sys.executable, "-c", prelude + _CPU_USER], env=env, capture_output=True, text=True,
                          timeout=600)


# The three runs below, started side by side when the first of them is asked for (each is a fresh
# interpreter importing torch, Triton and moekit: seconds of start-up, mostly on one core).
RUNS = {"cpu user": ({}, ""), "TRITON_INTERPRET=0": ({"TRITON_INTERPRET": "0"}, ""),
        "triton imported first": ({}, "import triton\n")}


@pytest.fixture(scope="module")
def runs():
    pool = ThreadPoolExecutor(max_workers=len(RUNS))
    futures = {name: pool.submit(_run_as_cpu_user, *how) for name, how in RUNS.items()}
    yield {name: future.result for name, future in futures.items()}
    pool.shutdown(wait=True)


def test_a_cpu_user_gets_a_working_interpreter_run_and_one_note(runs):
    run = runs["cpu user"]()
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert lines[0] == "TRITON_INTERPRET 1"
    errors = [float(line.split()[1]) for line in lines if line.startswith("relerr")]
    assert len(errors) == 2 and max(errors) < 1e-4
    assert run.stderr.count("Triton's CPU interpreter") == 1  # the note, once for the two calls


@pytest.mark.parametrize("how", ["TRITON_INTERPRET=0", "triton imported first"])
def test_kernels_set_up_for_the_gpu_refuse_cpu_tensors_in_one_line(how, runs):
    # "triton imported first": too late to turn the interpreter on, Triton's own helpers are set up for the GPU
    run = runs[how]()
    assert run.returncode == 3, run.stderr[-2000:]
    error = [line for line in run.stdout.splitlines() if line.startswith("ERROR")]
    assert len(error) == 1 and "x is on cpu" in error[0] and "TRITON_INTERPRET=1" in error[0]
    assert "Triton's CPU interpreter" in error[0] and "\n" not in error[0]

