"""Change a checkpoint's number of KV heads by mean-pooling K and V heads: MHA -> GQA -> MQA.

This is the conversion of the GQA paper (Ainslie et al. 2023, "GQA: Training Generalized
Multi-Query Transformer Models from Multi-Head Checkpoints", section 2.1): to go from n_kv KV heads
to n_new, split the old heads into n_new groups of consecutive heads and replace each group's key
and value projections by their mean (the paper found the mean better than keeping one head of each
group or starting the pooled heads at random). It follows this with a short "uptraining" run (5% of
the pre-training steps) to recover the lost quality; here there is none, so expect a worse model:
how much worse is what `minillm.tools.evaluate.perplexity` measures.

Why consecutive heads: query head h reads KV head h // (n_heads // n_kv). After conversion it reads
h // (n_heads // n_new), which is the group that its old KV head falls in, because
(h // (n_heads // n_kv)) // (n_kv // n_new) == h // (n_heads // n_new). So every query head keeps
attending to (the average of) the keys and values it attended to before.

Why pooling rows is safe with RoPE: HF stores each head's k_proj rows in the half-split RoPE order
(dims j and j + head_dim/2 form a rotated pair). Every head uses the same order and the rotation is
linear, so the mean of rotated heads is the rotation of the mean head: averaging row r of every head
in a group commutes with RoPE.

What it buys: the KV cache shrinks by n_kv / n_new (`ModelConfig.kv_bytes_per_token`), and so does
the memory traffic of decode attention. The result is an ordinary HF checkpoint that transformers
and minillm both load.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from minillm.backend import STORAGE_DTYPES, as_f32, to_dtype
from minillm.model.config import ModelConfig
from minillm.checkpoints.weights import copy_tokenizer_files, load_hf_dir, save_hf_dir

def convert_kv_heads(config: ModelConfig, tensors: dict[str, np.ndarray],
                     n_kv_heads: int) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """(config, HF-named tensors) with `n_kv_heads` KV heads, each the mean of a group of old ones.

    Raises ValueError unless n_kv_heads divides the current number of KV heads (pooling only
    removes heads). Tensors other than k_proj and v_proj are passed through untouched.
    """
    n_kv = config.n_kv_heads
    check_kv_heads(config, n_kv_heads)
    if n_kv_heads == n_kv:
        return config, dict(tensors)
    new_config = config.replace(n_kv_heads=n_kv_heads)
    out = dict(tensors)
    for i in range(config.n_layers):
        for name in ("k_proj", "v_proj"):
            key = f"model.layers.{i}.self_attn.{name}.weight"
            out[key] = pool_heads(tensors[key], n_kv, n_kv_heads, config.head_dim)
    return new_config, out


def check_kv_heads(config: ModelConfig, n_kv_heads: int) -> None:
    """ValueError with a one-line reason if `config` cannot be pooled down to `n_kv_heads`."""
    n_kv, n_heads = config.n_kv_heads, config.n_heads
    if config.attention != "gqa":
        raise ValueError(f"KV-head pooling needs a GQA/MHA model; this one uses {config.attention} attention")
    if getattr(config, "quantization", None):
        raise ValueError("these weights are stored quantized: pool the KV heads of the unquantized "
                         "checkpoint, then quantize the result")
    if n_kv_heads < 1 or n_kv % n_kv_heads:
        divisors = [d for d in range(1, n_kv + 1) if n_kv % d == 0]
        raise ValueError(f"cannot pool {n_kv} KV heads into {n_kv_heads}: the new count must divide "
                         f"{n_kv} (n_heads {n_heads}); choose one of {', '.join(map(str, divisors))}")


def pool_heads(w: np.ndarray, n_kv: int, n_new: int, head_dim: int) -> np.ndarray:
    """Mean of each group of n_kv // n_new consecutive heads of a k/v projection, in w's dtype.

    w: [n_kv * head_dim, dim] -> [n_new * head_dim, dim]
    """
    dim = w.shape[1]
    heads = as_f32(w).astype(np.float64).reshape(n_new, n_kv // n_new, head_dim, dim)  # [n_new, group, hd, dim]
    pooled = heads.mean(axis=1).reshape(n_new * head_dim, dim)                          # [n_new * hd, dim]
    # Store as the checkpoint stores (uint16 = bf16 bits), so the file keeps one dtype throughout.
    stored = {np.dtype(v): k for k, v in STORAGE_DTYPES.items()}.get(w.dtype, "float32")
    return to_dtype(pooled.astype(np.float32), stored)


def convert_kv_heads_dir(src: str | Path, dst: str | Path, n_kv_heads: int,
                         progress: bool = False) -> Path:
    """Write a copy of the HF-layout checkpoint `src` to `dst` with `n_kv_heads` KV heads.

    The tokenizer files come along, so `dst` is a complete model for minillm and transformers.
    """
    src, dst = Path(src), Path(dst)
    if dst.resolve() == src.resolve():
        raise ValueError(f"{dst}: the destination must differ from the source (its weights are being read)")
    config, tensors = load_hf_dir(src)
    new_config, new_tensors = convert_kv_heads(config, tensors, n_kv_heads)
    copy_tokenizer_files(src, dst)
    return save_hf_dir(dst, new_config, new_tensors, progress=progress)
