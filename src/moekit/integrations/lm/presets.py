"""transformers MoE models at the real dimensions of public checkpoints, randomly initialized.

Nothing is downloaded: the configuration is written here from the models' published
dimensions (hidden size, expert width, experts, top-k, attention heads, vocabulary) and the
weights are drawn on the target device, seeded. Only the depth is chosen by the caller
(``layers``; the real depth is in :data:`REAL_LAYERS`), since a benchmark of the MoE blocks'
speed needs their dimensions, not all of their layers.

* ``olmoe-1b-7b``: OLMoE-1B-7B (64 experts of width 1024, top-8, hidden 2048, 16 layers).
* ``qwen3-30b-a3b``: Qwen3-30B-A3B (128 experts of width 768, top-8 renormalized, hidden 2048,
  32 query / 4 key-value heads of 128, 48 layers).
* ``mixtral-8x7b``: Mixtral-8x7B (8 experts of width 14336, top-2, hidden 4096, 32 / 8 heads,
  32 layers).
* ``tiny-olmoe`` / ``tiny-qwen3`` / ``tiny-mixtral``: the same architectures at toy size, for
  CPU runs of the same code.
"""

from __future__ import annotations

import torch

MODEL_PRESETS = ("olmoe-1b-7b", "qwen3-30b-a3b", "mixtral-8x7b", "tiny-olmoe", "tiny-qwen3", "tiny-mixtral")
REAL_LAYERS = {"olmoe-1b-7b": 16, "qwen3-30b-a3b": 48, "mixtral-8x7b": 32}


def preset_config(name: str, *, layers: int | None = None):
    """The transformers config of preset ``name`` with ``layers`` decoder layers (default: the
    real depth; 2 for the tiny ones)."""
    import transformers

    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(MODEL_PRESETS)}")
    depth = layers if layers is not None else REAL_LAYERS.get(name, 2)
    if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= 256:
        raise ValueError(f"layers must be an int in [1, 256], got {layers!r}")
    common = dict(num_hidden_layers=depth, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if name == "olmoe-1b-7b":
        return transformers.OlmoeConfig(**common, vocab_size=50304, hidden_size=2048, intermediate_size=1024,
                                        num_experts=64, num_experts_per_tok=8, num_attention_heads=16,
                                        num_key_value_heads=16, max_position_embeddings=4096, norm_topk_prob=False)
    if name == "qwen3-30b-a3b":
        return transformers.Qwen3MoeConfig(**common, vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                           moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                           num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                           max_position_embeddings=4096, norm_topk_prob=True, decoder_sparse_step=1,
                                           mlp_only_layers=[])
    if name == "mixtral-8x7b":
        return transformers.MixtralConfig(**common, vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                          num_local_experts=8, num_experts_per_tok=2, num_attention_heads=32,
                                          num_key_value_heads=8, max_position_embeddings=4096)
    tiny = dict(common, vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=512)
    if name == "tiny-olmoe":
        return transformers.OlmoeConfig(**tiny, intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    if name == "tiny-qwen3":
        return transformers.Qwen3MoeConfig(**tiny, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                                           num_experts_per_tok=2, head_dim=16, norm_topk_prob=True,
                                           decoder_sparse_step=1, mlp_only_layers=[])
    return transformers.MixtralConfig(**tiny, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)


def random_model(name: str, *, layers: int | None = None, dtype=torch.bfloat16, device="cpu", seed: int = 0):
    """A causal LM of preset ``name``, weights drawn on ``device`` from ``seed``, in eval mode."""
    import transformers

    config = preset_config(name, layers=layers)
    cls = {"OlmoeConfig": transformers.OlmoeForCausalLM, "Qwen3MoeConfig": transformers.Qwen3MoeForCausalLM,
           "MixtralConfig": transformers.MixtralForCausalLM}[type(config).__name__]
    torch.manual_seed(seed)
    if torch.device(device).type == "cuda":
        torch.cuda.manual_seed(seed)
    with torch.device(device):
        model = cls(config).to(dtype)
    return model.eval()


def random_prompts(vocab_size: int, batch: int, length: int, *, seed: int = 0, device="cpu") -> torch.Tensor:
    """``[batch, length]`` token ids drawn uniformly from the vocabulary (ids 3 and up: no
    special token), seeded."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (batch, length), generator=g).to(device)
