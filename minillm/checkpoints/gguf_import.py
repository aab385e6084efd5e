"""GGUF (llama.cpp's file format) -> ModelConfig + dequantized tensors with HF names.

Three things happen to each tensor:
1. its llama.cpp name becomes the HF name (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`);
2. it is dequantized (Q4_1, Q8_0, Q4_K, ...), one tensor at a time: Q4_1 and Q8_0 by gguf_file.py (the same
   arithmetic as `gguf.quants`, in half the time), every other type by `gguf.quants`;
3. attn_q / attn_k get their rows un-permuted. llama.cpp's converter reorders the rows of each head
   so RoPE rotates adjacent pairs (x0, x1), (x2, x3), ...; HF's RoPE rotates the two halves of a
   head (x_i, x_{i + head_dim/2}). We put the rows back in HF order, so one RoPE fits every source.

`convert.convert` writes the result as a minillm weights dir (HF layout, see weights.py).
"""
from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from minillm.model.config import ConfigError, ModelConfig, require_int, require_number
from minillm.errors import MiniLLMError
from minillm.backend import to_dtype
from minillm.checkpoints.shapes import count_mismatch, expected_shapes, numbered  # noqa: F401  (quantize.py reads expected_shapes here)
from minillm.checkpoints.gguf_file import GGUFFile, dequantize
from minillm.checkpoints.gguf_gpt_oss import gpt_oss_config, gpt_oss_pieces, is_gpt_oss_tensor
from minillm.checkpoints.gguf_moe import is_moe_tensor, moe_fields, moe_hf_tensors
from minillm.checkpoints.hf_layouts import split_fused

# Above this many bytes of float32 weights, the default output dtype is float16: a 7B model is then
# 14 GB instead of 28 GB, which fits a 24 GB machine.
F32_LIMIT_BYTES = 8 * 10**9

# llama.cpp tensor name -> HF name ("{i}" is the layer index).
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Qwen3 and Gemma 3 (llama.cpp's "qwen3", "gemma3"): QK-norm, and Gemma's sandwich norms. Gemma's ffn_norm
# norms the MLP input as Llama's does, but HF names it apart (post_attention_layernorm is its attention-output norm).
_QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_SANDWICH_NAMES = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                   "post_ffw_norm": "post_feedforward_layernorm"}
# Phi-3 / Phi-4-mini (llama.cpp's "phi3"): q/k/v and gate/up stay fused; hf_layouts.split_fused splits them.
_PHI3_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_PHI3_ROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")   # read into the config
GGUF_ARCHITECTURES = ("llama", "qwen3", "qwen3moe", "gemma3", "phi3", "gpt-oss")
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
_LAYER_INDEX = re.compile(r"blk\.(\d+)\.")
_ROUTER = re.compile(r"blk\.\d+\.ffn_gate_inp\.weight")



def hf_name(gguf_name: str, config: ModelConfig | None = None) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for tensors we don't use.
    config: the model's, for the norms Qwen3 and Gemma 3 add (without it only Llama's are named)."""
    if m := _BLOCK.fullmatch(gguf_name):
        part = _LAYER_NAMES.get(m.group(2))
        if config is not None and config.qk_norm:
            part = part or _QK_NORM_NAMES.get(m.group(2))
        if config is not None and config.sandwich_norms:
            part = _SANDWICH_NAMES.get(m.group(2), part)
        if config is not None and config.family == "phi3":
            part = _PHI3_NAMES.get(m.group(2), part)
        return f"model.layers.{m.group(1)}.{part}.weight" if part else None
    base = gguf_name.removesuffix(".weight")
    return f"{_GLOBAL_NAMES[base]}.weight" if base in _GLOBAL_NAMES else None


def permuted_qk(config: ModelConfig) -> bool:
    """llama.cpp permutes q/k rows for its "llama" architecture only (Qwen3, Gemma 3, Phi-3, GPT-OSS rotate HF's halves)."""
    return not (config.qk_norm or config.sandwich_norms or config.family in ("phi3", "gpt_oss"))


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order (adjacent RoPE pairs) -> HF order (half-split RoPE pairs).

    Within each head llama.cpp stores row 2*i + j for HF row j*(head_dim/2) + i (j = 0, 1).
    """
    out_dim, in_dim = w.shape                                    # [n_heads * head_dim, dim]
    half = out_dim // n_heads // 2
    w = w.reshape(n_heads, half, 2, in_dim)                      # [head, i, j, dim]: GGUF order
    return w.swapaxes(1, 2).reshape(out_dim, in_dim)             # [head, j, i, dim]: HF order


# ---- reading ---------------------------------------------------------------------------------------
def open_gguf(path: str | Path):
    """A GGUFFile (gguf_file.py: GGUFReader's fields and tensors, read in a fraction of the time) for
    `path`, or a MiniLLMError naming what is wrong with the file."""
    path = Path(path)
    if not path.is_file():
        raise MiniLLMError(f"{path}: file not found")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise MiniLLMError(f"{path}: not a GGUF file (it does not start with the bytes 'GGUF')")
    try:
        return GGUFFile(path)
    except Exception as e:  # the reader raises ValueError/IndexError/... on short or garbled files
        raise MiniLLMError(f"{path}: truncated or corrupt GGUF file ({type(e).__name__}: {e})") from None


def _meta(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _f32(x: float) -> float:
    """GGUF stores floats as float32: 1e-5 reads back as 9.99999974e-06. Give the short decimal."""
    return float(str(np.float32(x)))


def config_from_gguf(reader, path: str | Path = "") -> ModelConfig:
    """Build a ModelConfig from a GGUF's metadata: llama (and Llama-shaped: Mistral, Mixtral), qwen3, qwen3moe, gemma3."""
    arch = _meta(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise MiniLLMError(f"{path}: unsupported GGUF architecture {arch!r} (supported: {', '.join(GGUF_ARCHITECTURES)}; "
                           f"'llama' covers Llama-shaped models such as Mistral and SmolLM2)")

    def get(key, default=None):
        return _meta(reader, f"{arch}.{key}", default)

    names = {t.name for t in reader.tensors}
    n_heads = get("attention.head_count")
    dim = get("embedding_length")
    vocab = get("vocab_size") or len(_meta(reader, "tokenizer.ggml.tokens", []))
    if not vocab:
        vocab = next(int(t.shape[1]) for t in reader.tensors if t.name == "token_embd.weight")
    rope_scaling = None
    if get("rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": _f32(get("rope.scaling.factor"))}
    elif get("rope.scaling.type") not in (None, "none") and arch != "gpt-oss":   # (gpt-oss: YaRN, gguf_gpt_oss.py)
        # ignoring it would rotate every position wrongly
        raise MiniLLMError(f"{path}: llama.rope.scaling.type={get('rope.scaling.type')!r} is not implemented "
                           "for GGUF files (only linear)")
    if "rope_freqs.weight" in names:
        raise MiniLLMError(f"{path}: the rope_freqs tensor (Llama 3.1-style RoPE scaling) is not implemented for "
                           "GGUF files: convert the model's HF checkpoint instead")
    sliding_window = get("attention.sliding_window")
    try:
        for key in ("block_count", "embedding_length", "attention.head_count", "feed_forward_length"):
            require_int(get(key), f"{arch}.{key}")
        for key in ("attention.head_count_kv", "attention.key_length", "context_length", "attention.sliding_window"):
            if get(key) is not None:            # phi3 writes a window of 0 for none (Phi-4-mini)
                require_int(get(key), f"{arch}.{key}", minimum=0 if (arch, key) == ("phi3", "attention.sliding_window") else 1)
        require_number(get("attention.layer_norm_rms_epsilon", 1e-5), f"{arch}.attention.layer_norm_rms_epsilon", 0.0, 1.0)
        require_number(get("rope.freq_base", 10000.0), f"{arch}.rope.freq_base", low=1.0)
    except ConfigError as e:
        raise MiniLLMError(f"{path}: {e}") from None
    _check_counts(reader, get("block_count"), get("expert_count"), path)
    try:
        return ModelConfig(
            vocab_size=int(vocab),
            dim=dim,
            n_layers=get("block_count"),
            n_heads=n_heads,
            n_kv_heads=get("attention.head_count_kv", n_heads),
            ffn_dim=get("feed_forward_length"),
            head_dim=get("attention.key_length") or get("rope.dimension_count") or dim // n_heads,
            norm_eps=_f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=_f32(get("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_seq_len=get("context_length", 2048),
            tie_embeddings="output.weight" not in names,
            sliding_window=sliding_window,
            bos_token_id=_meta(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_id=_meta(reader, "tokenizer.ggml.eos_token_id"),
            family="mixtral" if get("expert_count") else "mistral" if sliding_window else "llama",
            **moe_fields(get),                                      # Mixtral: experts (gguf_moe.py)
        ) if arch == "llama" else _phi3_config(get, names, vocab, reader) if arch == "phi3" else \
            gpt_oss_config(get, names, vocab, lambda key: _meta(reader, key)) if arch == "gpt-oss" else \
            _qwen3_gemma3_config(arch, get, names, vocab, rope_scaling, reader)
    except (TypeError, ValueError) as e:
        raise MiniLLMError(f"{path}: incomplete llama metadata ({e})") from None


def _phi3_config(get, names: set, vocab: int, reader) -> ModelConfig:
    """A phi3 GGUF's config: rope.dimension_count is the rotary share of a head (Phi-4-mini: 3/4), LongRoPE's
    factors are the rope_factors_short/long tensors and its gain a key, and a window of 0 means none."""
    dim, n_heads, context = get("embedding_length"), get("attention.head_count"), get("context_length", 4096)
    head_dim = dim // n_heads
    scaling = None
    if set(_PHI3_ROPE_FACTORS) <= names:
        factors = {t.name: [float(v) for v in np.asarray(t.data, dtype=np.float32).ravel()]
                   for t in reader.tensors if t.name in _PHI3_ROPE_FACTORS}
        original = get("rope.scaling.original_context_length", context)
        scaling = {"rope_type": "longrope", "short_factor": factors[_PHI3_ROPE_FACTORS[0]],
                   "long_factor": factors[_PHI3_ROPE_FACTORS[1]], "factor": context / original,
                   "original_max_position_embeddings": original,
                   "attention_factor": _f32(get("rope.scaling.attn_factor", 1.0))}
    return ModelConfig(
        vocab_size=int(vocab), dim=dim, n_layers=get("block_count"), n_heads=n_heads,
        n_kv_heads=get("attention.head_count_kv", n_heads), ffn_dim=get("feed_forward_length"), head_dim=head_dim,
        norm_eps=_f32(get("attention.layer_norm_rms_epsilon", 1e-5)), rope_theta=_f32(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling, max_seq_len=context, tie_embeddings="output.weight" not in names,
        sliding_window=get("attention.sliding_window") or None, family="phi3",
        partial_rotary_factor=(get("rope.dimension_count") or head_dim) / head_dim,
        bos_token_id=_meta(reader, "tokenizer.ggml.bos_token_id"), eos_token_id=_meta(reader, "tokenizer.ggml.eos_token_id"))


def _qwen3_gemma3_config(arch: str, get, names: set, vocab: int, rope_scaling, reader) -> ModelConfig:
    """A qwen3, qwen3moe or gemma3 GGUF's config. What llama.cpp's converter does not write, llama.cpp fixes in code, and
    so does this: Gemma 3's windowed layers are 5 of every 6, their RoPE base is 10000, and scores are scaled by
    1/sqrt(head_dim) (by 1/sqrt(hidden / heads) for the 62-layer 27B)."""
    n_layers, dim, n_heads = get("block_count"), get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length") or dim // n_heads
    fields = dict(family="qwen3", qk_norm=True)
    if arch == "qwen3moe":              # llama.cpp renormalizes the top-k weights of qwen3moe always: so do we
        fields = dict(family="qwen3_moe", qk_norm=True, n_experts=get("expert_count"),
                      n_experts_per_token=get("expert_used_count"), moe_ffn_dim=get("expert_feed_forward_length"),
                      router="softmax", norm_topk_prob=True)
    if arch == "gemma3":
        window, softcap = get("attention.sliding_window"), get("final_logit_softcapping")
        fields = dict(family="gemma3_text", qk_norm=True, norm_plus_one=True, sandwich_norms=True,
                      activation="gelu_tanh", embed_scale=True, rope_local_theta=10000.0,
                      layer_windows=tuple(None if (i + 1) % 6 == 0 or window is None else window for i in range(n_layers)),
                      attn_scalar=float(dim // n_heads if n_layers == 62 else head_dim),
                      final_softcap=None if softcap is None else _f32(softcap))
        if len(set(fields["layer_windows"])) == 1:              # every layer windowed (or none): one window
            fields |= dict(layer_windows=None, sliding_window=fields["layer_windows"][0])
    return ModelConfig(
        vocab_size=int(vocab), dim=dim, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=get("attention.head_count_kv", n_heads), ffn_dim=get("feed_forward_length"), head_dim=head_dim,
        norm_eps=_f32(get("attention.layer_norm_rms_epsilon", 1e-6)), rope_theta=_f32(get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling, max_seq_len=get("context_length", 2048), tie_embeddings="output.weight" not in names,
        bos_token_id=_meta(reader, "tokenizer.ggml.bos_token_id"), eos_token_id=_meta(reader, "tokenizer.ggml.eos_token_id"),
        **fields)


def _check_counts(reader, n_layers: int, n_experts: int | None, path) -> None:
    """block_count and expert_count are those of the tensors in the file: checked before anything is
    built per layer or per expert, so a lying count is refused at once (not after 2^31 layers' names)."""
    layers = count_mismatch(n_layers, numbered((t.name for t in reader.tensors), _LAYER_INDEX), "layer")
    if layers:
        raise MiniLLMError(f"{path}: llama.block_count={n_layers}, but {layers}")
    routers = [t for t in reader.tensors if _ROUTER.fullmatch(t.name)]     # [E, dim]: E experts
    present = int(routers[0].shape[-1]) if routers else 0
    if (n_experts or 0) != present:
        raise MiniLLMError(f"{path}: llama.expert_count={n_experts}, but the router "
                           f"{routers[0].name if routers else 'blk.N.ffn_gate_inp.weight'} has {present} experts")


def default_dtype(config: ModelConfig) -> str:
    """float32 when the model fits in F32_LIMIT_BYTES as float32, else float16."""
    return "float32" if config.n_params * 4 <= F32_LIMIT_BYTES else "float16"


def load_gguf(path: str | Path, dtype: str | None = None, progress: bool = False,
              reader=None) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read a llama GGUF file: its config and its tensors, dequantized, under HF names.

    dtype: "float32" | "float16" | "bfloat16" (uint16 bits); None picks `default_dtype(config)`.
    Tensors are dequantized one at a time, so peak memory is the output plus one float32 tensor.
    `reader`: an already open GGUFFile of `path` (open_gguf: parse the metadata once).
    """
    reader = reader or open_gguf(path)
    config = config_from_gguf(reader, path)
    dtype = dtype or default_dtype(config)
    config = config.replace(torch_dtype=dtype)
    shapes = expected_shapes(config)

    tensors: dict[str, np.ndarray] = {}
    for t in tqdm(reader.tensors, desc=f"dequantizing {Path(path).name}", unit="tensor", disable=not progress):
        gpt_oss = config.family == "gpt_oss" and is_gpt_oss_tensor(t.name)     # its own names (gguf_gpt_oss.py)
        name = t.name if is_moe_tensor(t.name) or gpt_oss else hf_name(t.name, config)
        if name is None:
            if t.name != "rope_freqs.weight" and t.name not in _PHI3_ROPE_FACTORS:   # warned about / read already
                warnings.warn(f"{path}: skipping unknown tensor {t.name}")
            continue
        try:
            with np.errstate(over="ignore", invalid="ignore"):   # corrupt scales: checked just below
                w = dequantize(t.data, t.tensor_type)            # float32, [out, in]
        except NotImplementedError:
            raise MiniLLMError(f"{path}: tensor {t.name} uses quant type {t.tensor_type.name}, "
                               f"which gguf {_gguf_version()} cannot dequantize") from None
        if not np.isfinite(w).all():     # corrupt bytes: a garbled fp16 scale dequantizes to NaN/Inf
            raise MiniLLMError(f"{path}: tensor {t.name} holds {int((~np.isfinite(w)).sum())} NaN/Inf values "
                               f"(the file is corrupt)")
        pieces = (gpt_oss_pieces(t.name, w, config) if gpt_oss else
                  moe_hf_tensors(t.name, w, config) if is_moe_tensor(t.name) else {name: w})   # stacked experts split
        pieces = split_fused(config, pieces)                    # Phi-3's fused q/k/v and gate/up: row blocks
        for name, w in pieces.items():
            if w.shape != shapes.get(name):
                raise MiniLLMError(f"{path}: tensor {t.name} has shape {w.shape}, "
                                   f"the metadata implies {shapes.get(name)}")
            tensors[name] = _hf_tensor(w, name, config, dtype)
    missing = sorted(set(shapes) - set(tensors))
    if missing:
        raise MiniLLMError(f"{path}: {len(missing)} weights missing, e.g. {missing[0]}")
    return config, tensors


def _hf_tensor(w: np.ndarray, name: str, config: ModelConfig, dtype: str) -> np.ndarray:
    """A dequantized GGUF tensor in HF's row order and the output dtype, owning its memory."""
    if name.endswith("q_proj.weight") and permuted_qk(config):
        w = unpermute_rows(w, config.n_heads)
    elif name.endswith("k_proj.weight") and permuted_qk(config):
        w = unpermute_rows(w, config.n_kv_heads)
    elif name.endswith("norm.weight") and config.norm_plus_one:   # llama.cpp stores Gemma's gain 1 + w; HF stores w
        w = w - np.float32(1.0)
    w = to_dtype(w, dtype)
    return w if w.flags.owndata else w.copy()      # F32 data is a view of the file (experts: of their stack): copy


def _gguf_version() -> str:
    from importlib.metadata import version
    return version("gguf")
