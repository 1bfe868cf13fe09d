"""The patched experts call against transformers' own on the same inputs (calc_diff, bf16 and FP8), at
Mixtral-8x7B and OLMoE-1B-7B dimensions: the kernels agree where greedy tokens of a random-init
model do not (near-tied logits)."""
import torch
from moekit.fp8 import calc_diff
from moekit.integrations.lm.presets import random_model
from moekit.integrations.transformers import moe_blocks, patch, unpatch
for preset in ("mixtral-8x7b", "olmoe-1b-7b"):
    model = random_model(preset, layers=1, device="cuda")
    ex = moe_blocks(model)[0][1].experts
    E, _, H = ex.gate_up_proj.shape
    K = model.config.num_experts_per_tok
    outs = {}
    for kind in ("transformers", "fused", "fused_fp8"):
        if kind != "transformers":
            patch(model, experts=kind)
        for M in (1, 16, 64, 300):
            g = torch.Generator().manual_seed(M)
            x = torch.randn(M, H, generator=g).cuda().bfloat16()
            ids = torch.rand(M, E, generator=g).argsort(1)[:, :K].cuda()
            w = torch.softmax(torch.randn(M, K, generator=g), -1).cuda().bfloat16()
            with torch.no_grad():
                outs[(kind, M)] = ex(x, ids, w).float()
        if kind != "transformers":
            unpatch(model)
    for kind in ("fused", "fused_fp8"):
        print(preset, kind, [f"M={M}: {calc_diff(outs[(kind, M)], outs[('transformers', M)]):.2e}" for M in (1, 16, 64, 300)])
    del model
    torch.cuda.empty_cache()
