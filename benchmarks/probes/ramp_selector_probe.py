"""The RaMP selector's cost on this GPU for every shipped model of its kind: eager calls
(host launch included), the same call replayed in a CUDA graph (the kernels alone), and a
whole ``choose`` with its host read, eager and through the selector's captured selection. One
JSON file.

    PYTHONPATH=src python3 benchmarks/probes/ramp_selector_probe.py --out $OUT/selector.json
"""

from __future__ import annotations

import argparse
import json

import torch

from moekit.bench.ramp import selector_cost
from moekit.bench.report import environment
from moekit.ramp.modelfile import SHIPPED, load_model
from moekit.ramp.regions import hardware_for
from moekit.ramp.select import Selector

LAYERS = {"qwen3-30b-a3b": 48, "olmoe-1b-7b": 16, "mixtral-8x7b": 32}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    hw = hardware_for()
    out = {"environment": environment(), "gpu": hw.key, "models": {}}
    for path in sorted(SHIPPED.glob(f"{hw.key}-*-token-*.json")):
        model, _ = load_model(path)
        sel = Selector(model.shape, dtype=torch.float8_e4m3fn if model.elem_bytes == 1 else torch.bfloat16,
                       model=model)
        name = model.shape.name
        res = selector_cost(sel, model.shape, [1, 16, 256], model.shape.num_experts, LAYERS.get(name, 61))
        out["models"][path.name] = {"shape": name, "cost": res}
        for M, r in res.items():
            print(f"{path.name} M={M}: eager {r['device_us']:.1f} µs, graph {r['graph_us']:.2f} µs, "
                  f"choose + host read {r['choose_with_host_read_us']:.1f} µs (graphed "
                  f"{r['graphed_choose_with_host_read_us']:.1f} µs), per layer {r['per_layer_us']:.2f} µs",
                  flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
