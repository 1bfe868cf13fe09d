"""The model's Placement against the dispatchers' ExpertPlacement, and the tax package's imports."""

import ast
import graphlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import moekit.tax
from moekit.ep.layout import ExpertPlacement
from moekit.tax.placement import Placement, assignment_gpus
from moekit.tax.topk import sample_routing


@pytest.mark.parametrize("num_experts, world_size", [(8, 1), (8, 2), (8, 4), (64, 8)])
def test_contiguous_placement_sends_every_assignment_where_the_dispatchers_do(num_experts, world_size):
    runtime = ExpertPlacement(num_experts, world_size)
    model = Placement.from_expert_placement(runtime)
    assert model.is_contiguous and (model.n_gpus, model.num_experts) == (world_size, num_experts)
    assert model.to_expert_placement() == runtime
    ids = sample_routing(37, num_experts, 2, samples=3, seed=world_size)
    ids[0, :5, 1] = -1  # masked slots go nowhere in both
    gpus = assignment_gpus(ids, model)
    valid = ids >= 0
    ranks = runtime.rank_of(torch.from_numpy(ids)).numpy()
    assert np.array_equal(gpus[valid], ranks[valid]) and np.all(gpus[~valid] == -1)


def test_placements_the_dispatchers_do_not_run_are_refused():
    replicated = Placement(np.array([[0, 1, 2], [3, 0, 1]]), 4, name="eplb")
    reordered = Placement(np.array([[1, 0], [2, 3]]), 4)
    for p in (replicated, reordered):
        assert not p.is_contiguous
        with pytest.raises(ValueError, match="contiguous"):
            p.to_expert_placement()


def test_tax_is_a_pure_model():
    """Importing every tax module loads nothing of bench, moe or kernels."""
    code = ("import sys, pkgutil, importlib, moekit.tax; "
            "[importlib.import_module('moekit.tax.' + m.name) for m in pkgutil.iter_modules(moekit.tax.__path__)]; "
            "bad = [m for m in sys.modules if m.startswith(('moekit.bench', 'moekit.moe', 'moekit.kernels'))]; "
            "assert not bad, bad")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_tax_modules_import_each_other_without_a_cycle():
    """The graph of imports between tax modules (function-level imports included) is acyclic."""
    package = Path(moekit.tax.__file__).parent
    graph = {}
    for path in package.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps |= {node.module} if node.module else {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("moekit.tax."):
                deps.add(node.module.split(".")[2])
        graph[path.stem] = deps - {"__init__"}
    order = list(graphlib.TopologicalSorter(graph).static_order())  # raises CycleError on a cycle
    assert {"bbb", "comm", "placement", "topk"} <= set(order)
