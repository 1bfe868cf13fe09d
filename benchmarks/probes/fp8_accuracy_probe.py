"""Developer probe: how far the FP8 expert-major kernels land from the emulated float64 reference.

``tests/kernels/test_kernels_fp8.py::test_expert_major``'s case (4 experts, H = N = 256, weight
blocks and activation groups scaled by 2**-2 .. 2**2, counts 5 / 0 / 20 / 1) over many random
token draws, run natively: the bm = 16 default form with its dots swapped onto the warpgroup MMA
(``KernelConfig.swap_ab``) and unswapped (mma.sync on fp16-upcast operands), and a bm = 64
config (warpgroup MMA, unswapped). Prints the worst relative error per variant against the
reference that re-quantizes the intermediate as the kernels do, and the worst ``calc_diff``
against the plain dequantized reference (the issue's bound, 1e-3).

    PYTHONPATH=src:. python3 benchmarks/probes/fp8_accuracy_probe.py [draws]
"""

from __future__ import annotations

import dataclasses
import importlib
import sys

import torch

from moekit.fp8 import calc_diff, dequantize_groups, quantize_groups
from moekit.kernels import KernelConfig, fused_moe_expert_major


def main() -> None:
    tests = importlib.import_module("tests.kernels.test_kernels_fp8")
    case = tests.Fp8Case(tests.SHAPE, seed=11)
    E, cap = tests.SHAPE.num_experts, 20
    counts = torch.tensor([5, 0, 20, 1])
    bm16 = tests.FORMS["two_launch_sk1"]
    variants = {"bm16 swapped": dataclasses.replace(bm16, swap_ab=True),
                "bm16 unswapped": dataclasses.replace(bm16, swap_ab=False),
                "bm64": KernelConfig(bm=64, bn=128, bk=128, num_warps=4, group_m=1)}
    worst = {name: [0.0, 0.0, -1] for name in variants}
    draws = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    for draw in range(draws):
        tq, ts = quantize_groups(case.tokens(E, cap).bfloat16(), 128)
        xd = dequantize_groups(tq, ts, dtype=torch.float64)
        for name, cfg in variants.items():
            y = fused_moe_expert_major(tq.cuda(), counts.cuda(), case.w13.cuda(), case.w2.cuda(), cfg,
                                       **case.weight_kwargs(), token_scales=ts.cuda()).cpu()
            for e, n in enumerate(counts.tolist()):
                if n:
                    err = tests._rel(y[e, :n], case.expert(e, xd[e, :n], True))
                    diff = calc_diff(y[e, :n], case.expert(e, xd[e, :n], False))
                    w = worst[name]
                    if err > w[0]:
                        w[0], w[2] = err, draw
                    w[1] = max(w[1], float(diff))
    print(f"{draws} draws on {torch.cuda.get_device_name()}:")
    for name, (err, diff, draw) in worst.items():
        print(f"  {name:15s} worst rel. error vs the emulated reference {err:.2e} (draw {draw}), "
              f"worst calc_diff vs the plain reference {diff:.2e}")


if __name__ == "__main__":
    main()
