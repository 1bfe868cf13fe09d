"""Tiny random transformers MoE models, built from configs (nothing downloaded).

transformers initializes weights with std 0.02, which makes a tiny model's MoE output a
rounding error next to the residual stream: a broken expert path would then leave the
logits unchanged. ``build`` redraws every matrix with std 1/sqrt(fan_in) so the experts
move the logits by O(1) (the tests check that they do).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 96
ARCHS = ("olmoe", "qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3")


def config(arch: str, *, hidden: int = 32, intermediate: int = 24, experts: int = 8, top_k: int = 2, layers: int = 2):
    """A tiny config of ``arch`` (its MoE blocks: ``experts`` experts of width ``intermediate``, top-``top_k``)."""
    common = dict(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=None,
                  eos_token_id=None, num_experts_per_tok=top_k)
    if arch == "olmoe":
        return transformers.OlmoeConfig(**common, intermediate_size=intermediate, num_experts=experts)
    if arch == "qwen3_moe":
        # Qwen3-MoE checkpoints renormalize the top-k weights; OLMoE's keep them as they are.
        return transformers.Qwen3MoeConfig(**common, moe_intermediate_size=intermediate, intermediate_size=2 * hidden,
                                           num_experts=experts, norm_topk_prob=True, head_dim=hidden // 4)
    if arch == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=intermediate, num_local_experts=experts)
    if arch == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**common, moe_intermediate_size=intermediate, intermediate_size=2 * hidden,
                                           shared_expert_intermediate_size=2 * intermediate, num_experts=experts)
    if arch == "deepseek_v3":
        # Grouped top-k (2 groups, 1 kept), the score bias set non-zero in build(), one dense layer first.
        common = dict(common, num_key_value_heads=4, num_hidden_layers=layers + 1)
        return transformers.DeepseekV3Config(**common, intermediate_size=2 * hidden, moe_intermediate_size=intermediate,
                                             n_routed_experts=experts, n_group=2, topk_group=1, first_k_dense_replace=1,
                                             n_shared_experts=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                                             qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.5)
    raise ValueError(arch)


MODEL_CLASSES = {
    "olmoe": "OlmoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
}


def build(arch: str, *, seed: int = 0, dtype=torch.float32, device="cpu", **shape):
    """The tiny model of ``arch`` in eval mode, every matrix redrawn with std 1/sqrt(fan_in)."""
    model = getattr(transformers, MODEL_CLASSES[arch])(config(arch, **shape)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's bias: make it change the picks
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return model.to(device=device, dtype=dtype)


def prompts(batch: int = 2, length: int = 12, seed: int = 1, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, length), generator=g).to(device)


def greedy(model, ids: torch.Tensor, new_tokens: int = 32) -> torch.Tensor:
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:]
