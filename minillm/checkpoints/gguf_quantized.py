"""A GGUF's quantized matrices loaded as they are stored, without a float copy: memory follows the file.

gguf_import.load_gguf dequantizes every tensor (a 7B Q4_K_M file of 4.4 GB becomes 14.5 GB of fp16).
Here each layer matrix of a type the model multiplies by directly stays in that type:

  Q4_0, Q4_1   -> quant.Int4Weight, groups of 32, fp16 scale and min: the same grid exactly. Q4_1 is
                  w = d·q + m (scale d, min m); Q4_0 is w = d·(q - 8) (scale d, min -8d: exact in fp16,
                  a power-of-two multiple). Only the nibbles move: GGUF puts a block's weights 0-15 in
                  the low nibbles and 16-31 in the high ones, int4 puts weight 2j low and 2j+1 high.
  Q8_0, Q4_K,  -> ggml_blocks.GGMLWeight, the file's bytes themselves (a view of the memory-mapped
  Q6_K            file), decoded a tile at a time in the matmul.
  MXFP4        -> formats.Mxfp4Weight (GPT-OSS's experts): the same codes and scales, nibbles re-laid out
                  (gguf_gpt_oss.py).

Every other type (Q5_K, IQ*, ...) and every non-matrix tensor (norms, the embedding: a lookup) is
dequantized as gguf_import does, after checking that the float copies fit in the memory available.
llama.cpp's Q/K row order (gguf_import.unpermute_rows) is kept as each weight's `row_order`, applied to
the matmul's output, so even those rows are not copied.
"""
from __future__ import annotations

import sys
import warnings
from collections import Counter
from pathlib import Path

import numpy as np

from minillm.backend import STORAGE_DTYPES
from minillm.checkpoints.gguf_file import dequantize
from minillm.checkpoints.gguf_import import (config_from_gguf, default_dtype, expected_shapes, hf_name, load_gguf,
                                             open_gguf, permuted_qk, unpermute_rows, _hf_tensor)
from minillm.checkpoints.gguf_gpt_oss import gpt_oss_pieces, is_gpt_oss_tensor, mxfp4_experts
from minillm.checkpoints.gguf_moe import is_moe_tensor, moe_hf_tensors
from minillm.checkpoints.hf_layouts import split_fused
from minillm.errors import MiniLLMError
from minillm.model.config import ModelConfig
from minillm.model.ggml_blocks import BLOCKS, GGMLWeight
from minillm.model.quant import Int4Weight, QuantizedWeight, is_layer_matrix, pack_int4

KEPT = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")     # the types a layer matrix keeps
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
_FUSED = ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight")     # Phi-3's, as gguf_import names them
MEMORY_MARGIN = 0.9     # of the memory available now, what the float copies may take


def load_gguf_kept(path: str | Path, reader=None) -> tuple[ModelConfig, dict]:
    """A llama GGUF's config and HF-named tensors, its KEPT-type layer matrices as quantized weights
    (module docstring), everything else dequantized. MiniLLMError if the float part would not fit."""
    reader = reader or open_gguf(path)
    config = config_from_gguf(reader, path)
    dtype = default_dtype(config)
    config = config.replace(torch_dtype=dtype)
    shapes = expected_shapes(config)
    kept = {t.name for t in reader.tensors if t.tensor_type.name in KEPT and _is_matrix(t.name, config)}
    if config.family == "gpt_oss":                               # its experts: MXFP4 as shipped
        kept |= {t.name for t in reader.tensors if t.tensor_type.name == "MXFP4" and "_exps." in t.name}
    _check_float_fits(reader, kept, dtype, path)
    tensors: dict = {}
    for t in reader.tensors:
        if t.name in kept:
            # NaN/Inf fp16 scales would reach the logits unexplained (MXFP4's are E8M0 powers of two)
            if t.tensor_type.name in SCALE_BYTES and not _finite_scales(t.data, t.tensor_type.name):
                raise MiniLLMError(f"{path}: tensor {t.name} has NaN/Inf block scales (the file is corrupt)")
            pieces = _kept_pieces(t, config)
        else:
            pieces = _float_pieces(t, config, dtype, path)
        for name, w in pieces.items():
            if tuple(w.shape) != shapes.get(name):
                raise MiniLLMError(f"{path}: tensor {t.name} has shape {tuple(w.shape)}, "
                                   f"the metadata implies {shapes.get(name)}")
            tensors[name] = w
    missing = sorted(set(shapes) - set(tensors))
    if missing:
        raise MiniLLMError(f"{path}: {len(missing)} weights missing, e.g. {missing[0]}")
    slow = sorted({t.tensor_type.name for t in reader.tensors
                   if _is_matrix(t.name, config) and t.name not in kept and t.tensor_type.name not in FLOAT_TYPES})
    if slow:
        _note(f"{Path(path).name}: {', '.join(slow)} layer matrices are dequantized to {dtype} at load "
              f"(kept quantized: {', '.join(KEPT)} only)")
    return config, tensors


def _is_matrix(gguf_name: str, config: ModelConfig | None = None) -> bool:
    """A layer matrix (or an expert's): what a quantized weight can stand for. The router stays float."""
    if is_moe_tensor(gguf_name):
        return "_exps." in gguf_name or not gguf_name.endswith("ffn_gate_inp.weight")
    name = hf_name(gguf_name, config)
    return name is not None and (is_layer_matrix(name) or name == "lm_head.weight" or name.endswith(_FUSED))


def _kept_pieces(t, config: ModelConfig) -> dict[str, QuantizedWeight]:
    """One stored matrix (a stack of experts: several) -> {HF name: its quantized weight}, no dequantizing."""
    kind = t.tensor_type.name
    if kind == "MXFP4":                                       # GPT-OSS's experts [E, out, row bytes]
        return gpt_oss_pieces(t.name, mxfp4_experts(t.data), config)
    if is_moe_tensor(t.name):
        # a stack of experts [E, out, row bytes] splits into one weight each; one expert's [out, row bytes] does not
        return {name: _weight(w, kind, None) for name, w in moe_hf_tensors(t.name, t.data, config).items()}
    name = hf_name(t.name, config)
    if name.endswith(_FUSED):                                 # Phi-3's q/k/v, gate/up: row blocks of the stored bytes
        return {n: _weight(rows, kind, None) for n, rows in split_fused(config, {name: t.data}).items()}
    heads = (config.n_heads if name.endswith("q_proj.weight") else
             config.n_kv_heads if name.endswith("k_proj.weight") else None)
    if not permuted_qk(config):                               # Qwen3, Gemma 3: llama.cpp kept HF's row order
        heads = None
    order = None if heads is None else unpermute_rows(np.arange(t.data.shape[0])[:, None], heads)[:, 0]
    return {name: _weight(t.data, kind, order)}


# where each block type keeps its fp16 scales (d, and dmin / m where it has them), in bytes from the block's start
SCALE_BYTES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, **{kind: size for kind, (_, size) in BLOCKS.items()}}


def _finite_scales(data: np.ndarray, kind: str) -> bool:
    """Every fp16 scale of a tensor's blocks is finite (2 bytes a block are read, not the codes)."""
    blocks = data.reshape(-1, BLOCK_BYTES[kind])
    return all(np.isfinite(blocks[:, at:at + 2].copy().view(np.float16)).all() for at in SCALE_BYTES[kind])


def _weight(data: np.ndarray, kind: str, row_order: np.ndarray | None) -> QuantizedWeight:
    """Block bytes [out, row bytes] of a KEPT type -> the weight that multiplies by them."""
    if kind in BLOCKS:
        return GGMLWeight(data, kind, row_order)
    rows = data if row_order is None else data[row_order]                     # Q4_0/Q4_1: copied anyway
    return q4_as_int4(rows, kind)


def q4_as_int4(data: np.ndarray, kind: str) -> Int4Weight:
    """Q4_0 / Q4_1 block bytes [out, n_blocks * (18 | 20)] -> the same values as int4 in groups of 32."""
    out_dim = data.shape[0]
    head = 2 if kind == "Q4_0" else 4                                          # fp16 d (, fp16 m)
    blocks = np.ascontiguousarray(data).reshape(out_dim, -1, head + 16)       # [out, n_blocks, bytes]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]                      # [out, n_blocks]
    if kind == "Q4_1":
        mins = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    else:
        with np.errstate(over="ignore"):
            mins = d * np.float16(-8)                                          # exact, unless |d| > 8188
        if not np.isfinite(mins[np.isfinite(d)]).all():
            raise MiniLLMError("a Q4_0 scale above 8188 has no int4 min in fp16 (-8d overflows): the file is corrupt")
    nibbles = blocks[..., head:]                                              # [out, n_blocks, 16]
    codes = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1)             # [out, n_blocks, 32]: weight order
    return Int4Weight(pack_int4(codes.reshape(out_dim, -1)), d, mins, codes.shape[1] * 32)


def _float_pieces(t, config: ModelConfig, dtype: str, path) -> dict[str, np.ndarray]:
    """A tensor dequantized as gguf_import.load_gguf does it (HF names, HF row order, `dtype`)."""
    gpt_oss = config.family == "gpt_oss" and is_gpt_oss_tensor(t.name)     # its own names (gguf_gpt_oss.py)
    name = t.name if is_moe_tensor(t.name) or gpt_oss else hf_name(t.name, config)
    if name is None:
        if t.name != "rope_freqs.weight" and not t.name.startswith("rope_factors_"):   # read into the config
            warnings.warn(f"{path}: skipping unknown tensor {t.name}")
        return {}
    try:
        with np.errstate(over="ignore", invalid="ignore"):
            w = dequantize(t.data, t.tensor_type)                              # float32 [out, in]
    except NotImplementedError:
        raise MiniLLMError(f"{path}: tensor {t.name} uses quant type {t.tensor_type.name}, "
                           f"which gguf cannot dequantize") from None
    if not np.isfinite(w).all():
        raise MiniLLMError(f"{path}: tensor {t.name} holds NaN/Inf values (the file is corrupt)")
    pieces = split_fused(config, gpt_oss_pieces(t.name, w, config) if gpt_oss else
                         moe_hf_tensors(t.name, w, config) if is_moe_tensor(t.name) else {name: w})
    return {n: _hf_tensor(w, n, config, dtype) for n, w in pieces.items()}


# ---- memory --------------------------------------------------------------------------------------
def available_memory() -> int | None:
    """Bytes of memory available to a new allocation now (Linux's MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _check_float_fits(reader, kept: set[str], dtype: str, path) -> None:
    """Refuse in one line before dequantizing what would not fit in the memory available now."""
    itemsize = np.dtype(STORAGE_DTYPES[dtype]).itemsize
    need = sum(int(np.prod(t.shape, dtype=np.float64)) for t in reader.tensors if t.name not in kept) * itemsize
    have = available_memory()
    if have is not None and need > MEMORY_MARGIN * have:
        types = sorted({t.tensor_type.name for t in reader.tensors if t.name not in kept} - set(FLOAT_TYPES))
        raise MiniLLMError(f"{path}: its {', '.join(types) or 'float'} tensors would take {need / 1e9:.1f} GB as "
                           f"{dtype}, and {have / 1e9:.1f} GB of memory is available (kept quantized: "
                           f"{', '.join(KEPT)} only)")


# ---- which path a load took ----------------------------------------------------------------------
def load_path(tensors: dict) -> str:
    """How a checkpoint's matrices are held: "kept quantized (Q4_K 193, Q6_K 33; ...)" or "float"."""
    kinds = Counter(_kind(w) for w in tensors.values() if isinstance(w, QuantizedWeight))
    floats = sum(1 for name, w in tensors.items() if not isinstance(w, QuantizedWeight)
                 and (is_layer_matrix(name) or name == "lm_head.weight"))
    if not kinds:
        return "float: every matrix dequantized at load"
    held = ", ".join(f"{kind} {n}" for kind, n in kinds.most_common())
    return f"kept quantized ({held} matrices)" + (f"; {floats} in float" if floats else "")


def _kind(w: QuantizedWeight) -> str:
    if isinstance(w, GGMLWeight):
        return w.kind
    if isinstance(w, Int4Weight):
        return "int4 g32 (Q4_0/Q4_1)" if w.group_size == 32 else f"int4 g{w.group_size}"
    return type(w).__name__


def _note(message: str) -> None:
    print(f"minillm: note: {message}", file=sys.stderr)


# ---- which path a load takes ---------------------------------------------------------------------
HOW = ("auto", "kept", "float")


def load_gguf_for_cpu(path: str | Path, reader=None, how: str = "auto") -> tuple[ModelConfig, dict]:
    """A GGUF's config and tensors for the CPU model, kept quantized or dequantized, as `how` says.

    "auto": dequantized to float32 where the model is small enough to run in fp32 (default_dtype) and
    that fits in the memory available: BLAS on fp32 is the fastest CPU path (SmolLM2: 11.8 tok/s vs
    5.2 kept quantized, lessons/BENCHMARKS.md, "GGUF kept quantized"); kept quantized otherwise, so
    that memory follows the file (GPT-OSS always: its experts stay MXFP4 as shipped). "float": dequantized
    (default_dtype) after the same memory check."""
    if how not in HOW:
        raise MiniLLMError(f"unknown GGUF load path {how!r}; choose one of {', '.join(HOW)}")
    reader = reader or open_gguf(path)
    config = config_from_gguf(reader, path)
    if how == "auto" and config.family == "gpt_oss":
        how = "kept"                     # its experts MXFP4 as shipped, as from its HF folder
    if how == "auto":
        have = available_memory()
        fits = have is None or 4 * config.n_params <= MEMORY_MARGIN * have
        how = "float" if default_dtype(config) == "float32" and fits else "kept"
    if how == "kept":
        return load_gguf_kept(path, reader)
    _check_float_fits(reader, set(), default_dtype(config), path)
    return load_gguf(path, reader=reader)
