"""Random small HF models, saved with `save_pretrained`, for parity tests against minillm."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
             max_position_embeddings=256)


def llama_config(n_heads=8, n_kv_heads=2, tied=False, **extra):
    from transformers import LlamaConfig
    return LlamaConfig(**(SMALL | dict(num_attention_heads=n_heads, num_key_value_heads=n_kv_heads,
                                       tie_word_embeddings=tied) | extra))


def mistral_config(sliding_window=6, **extra):
    from transformers import MistralConfig
    return MistralConfig(**(SMALL | dict(num_attention_heads=8, num_key_value_heads=2,
                                         sliding_window=sliding_window) | extra))


def qwen2_config(n_heads=8, n_kv_heads=2, tied=False, **extra):
    """Qwen2: Llama's shape with a bias on q, k and v (none on o or the MLP)."""
    from transformers import Qwen2Config
    return Qwen2Config(**(SMALL | dict(num_attention_heads=n_heads, num_key_value_heads=n_kv_heads,
                                       tie_word_embeddings=tied) | extra))


def save_random_model(config, path: Path, seed: int = 0):
    """Build an HF causal LM with random weights (norm gains and biases too), save it, return the HF model."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):     # default gains are all ones: make them matter
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):         # HF initializes biases to zero: a forgotten bias would pass
                p.copy_(0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].float().numpy()


def qwen3_config(n_heads=4, n_kv_heads=2, head_dim=32, tied=False, **extra):
    """Qwen3: Llama with QK-norm and an explicit head_dim (here n_heads * head_dim != hidden_size)."""
    from transformers import Qwen3Config
    return Qwen3Config(**(SMALL | dict(num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, head_dim=head_dim,
                                       tie_word_embeddings=tied) | extra))


def qwen3_moe_config(norm_topk_prob=True, **extra):
    """Qwen3-MoE: Qwen3's attention, every MLP a softmax-routed top-2 of 4 experts, no shared expert."""
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(**(SMALL | dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                                          num_experts_per_tok=2, moe_intermediate_size=32, initializer_range=0.1,
                                          norm_topk_prob=norm_topk_prob) | extra))


def gemma3_config(n_heads=4, n_kv_heads=1, head_dim=32, **extra):
    """Gemma 3 text: windowed and global layers interleaved, each with its own RoPE base."""
    from transformers import Gemma3TextConfig
    return Gemma3TextConfig(**(SMALL | dict(num_attention_heads=n_heads, num_key_value_heads=n_kv_heads,
                                            head_dim=head_dim, sliding_window=5, query_pre_attn_scalar=24,
                                            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                             "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})
                               | extra))
