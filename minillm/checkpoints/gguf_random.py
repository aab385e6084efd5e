"""A random-weight GGUF of any Llama shape, laid out as llama.cpp's quantizer lays out a Q4_K_M file.

Speed and memory do not depend on the weights' values, so a 7B-shaped file of random blocks measures
what a real one would (lessons/BENCHMARKS.md, "GGUF kept quantized"), without a 4 GB download. Written
with gguf-py's writer one tensor at a time: memory holds one tensor, never the model.

Q4_K_M, as llama.cpp's `llama_tensor_get_type` picks it: Q6_K for the LM head, and for attn_v and ffn_down
in the first and last eighth of the layers and every third layer between; Q4_K for every other matrix
and the embedding; F32 norms.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from minillm.model.config import ModelConfig
from minillm.checkpoints.shapes import expected_shapes

_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_SCALE_BYTES = {"Q4_K": (0, 2), "Q6_K": (208,)}       # where each block's fp16 super-block scales sit


def more_bits(layer: int, n_layers: int) -> bool:
    """Which layers' attn_v and ffn_down a Q4_K_M file keeps in Q6_K."""
    eighth = n_layers // 8
    return layer < eighth or layer >= 7 * eighth or (layer - eighth) % 3 == 2


def q4_k_m_type(gguf_name: str, n_layers: int) -> str:
    if gguf_name == "output.weight":
        return "Q6_K"
    if gguf_name.endswith("_norm.weight"):
        return "F32"
    parts = gguf_name.split(".")
    if parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down") and more_bits(int(parts[1]), n_layers):
        return "Q6_K"
    return "Q4_K"


def gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, i, rest = hf_name.split(".", 3)
        return f"blk.{i}.{_GGUF_NAMES[rest.removesuffix('.weight')]}.weight"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf_name]


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of a K-quant for a matrix [rows, cols], their fp16 scales making |w| ~ 0.05."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    out = rng.integers(0, 256, (rows, cols // block, block_bytes), dtype=np.uint8)
    for at in _SCALE_BYTES[kind]:
        d = rng.uniform(2e-5, 6e-5, out.shape[:2]).astype(np.float16)
        out[..., at:at + 2] = d.view(np.uint8).reshape(rows, -1, 2)
    return out.reshape(rows, -1)


def write_random_gguf(config: ModelConfig, path: str | Path, vocab_from: str | Path | None = None,
                      seed: int = 0) -> Path:
    """A Q4_K_M-laid-out GGUF of `config`'s (Llama) shape with random blocks; the tokenizer copied from the
    GGUF `vocab_from` if given (its vocabulary must have config.vocab_size tokens)."""
    import gguf
    from gguf.constants import GGMLQuantizationType as Q
    path = Path(path)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(config.max_seq_len)
    writer.add_embedding_length(config.dim)
    writer.add_block_count(config.n_layers)
    writer.add_feed_forward_length(config.ffn_dim)
    writer.add_head_count(config.n_heads)
    writer.add_head_count_kv(config.n_kv_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    if config.sliding_window:
        writer.add_sliding_window(config.sliding_window)
    if vocab_from is not None:
        for name, field in gguf.GGUFReader(vocab_from).fields.items():
            if name.startswith("tokenizer."):
                sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
                writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    shapes = expected_shapes(config)
    if config.tie_embeddings:
        shapes.pop("lm_head.weight", None)
    plan = []
    for hf, shape in shapes.items():
        name = gguf_name(hf)
        kind = q4_k_m_type(name, config.n_layers)
        if kind == "F32":
            writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
        else:
            block, block_bytes = gguf.GGML_QUANT_SIZES[Q[kind]]
            byte_shape = (shape[0], shape[1] // block * block_bytes)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=Q[kind])
        plan.append((shape, kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for shape, kind in plan:          # one tensor in memory at a time
        data = np.ones(shape, np.float32) if kind == "F32" else random_blocks(kind, *shape, rng)
        writer.write_tensor_data(data)
    writer.close()
    return path
