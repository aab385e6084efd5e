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
