"""Checkpoints in Hugging Face layout: a folder with config.json and safetensors files.

We read safetensors ourselves because the format is tiny: 8 bytes (little-endian u64) giving the
header length N, N bytes of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}}, then
the raw tensor bytes, offsets counted from the end of the header. Every tensor becomes a view into
one `np.memmap` of its file, so loading a 14 GB checkpoint reads nothing until a tensor is touched.

bf16: NumPy has no bfloat16. A BF16 tensor is returned as `np.uint16` holding the raw bits, and
`save_hf_dir` writes every `np.uint16` array as BF16 (no model stores real u16 weights, so the dtype
is free to carry that meaning). `bf16_to_f32` / `f32_to_bf16` convert.

Tensor names stay HF names: `model.embed_tokens.weight`, `model.layers.{i}.self_attn.q_proj.weight`,
..., `model.norm.weight`, `lm_head.weight` (absent when the embeddings are tied). A quantized
checkpoint (config.json has "quantization") stores each layer matrix `P.weight` as `P.qweight`,
`P.scales` and, for int4, `P.mins`: they load as plain arrays, and `quantized.gather` (called by the
Transformer) wraps them back into one weight each. `dtype=` never casts them.
"""
from __future__ import annotations

import json
import math
import shutil
import struct
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
from tqdm.auto import tqdm

from minillm.backend import STORAGE_DTYPES, bf16_to_f32, f32_to_bf16, to_dtype  # noqa: F401  (bf16 helpers re-exported)
from minillm.model.config import ConfigError, ModelConfig, require_int
from minillm.errors import MiniLLMError
from minillm.model.formats import FORMATS, stored_shapes
from minillm.model.quant import SUFFIXES as QUANT_SUFFIXES, QuantizedWeight
from minillm.model.quantized import quantized_matrices
from minillm.checkpoints.hf_quantized import translate_config, translate_tensors
from minillm.checkpoints.hf_layouts import split_fused
from minillm.checkpoints.tokenizer_files import save_hf
from minillm.checkpoints.shapes import expected_shapes, hf_count_mismatch  # noqa: F401  (expected_shapes read from here too)
from minillm.checkpoints.gguf_quantized import load_gguf_for_cpu

# safetensors dtype name <-> numpy dtype. BF16 travels as raw uint16 bits (see the module docstring).
_ST_TO_NP = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    # fp8 travels as its raw bytes, like bf16 (hf_quantized.py reads them as fp8); listed before U8 so that
    # uint8 still writes as U8
    "F8_E4M3": np.uint8, "F8_E5M2": np.uint8,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_NP_TO_ST = {np.dtype(v).str: k for k, v in _ST_TO_NP.items()}  # uint16 maps back to BF16

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# A folder may hold its weights as the GGUF they came in instead (a pulled SmolLM2, pull.py): exact
# values in 98 MB where fp32 safetensors take 538 MB, dequantized at load.
GGUF_WEIGHTS = "source.gguf"


# ---- safetensors: read ----------------------------------------------------------------------------
# The safetensors library's own limit on the JSON header: past it, a file is refused before it is parsed.
MAX_HEADER_BYTES = 100 * 2**20


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Map a .safetensors file; returns {name: lazily paged array view}. Raises MiniLLMError if corrupt.

    The header is checked as the safetensors library checks it: every tensor's bytes fit its dtype and
    shape, and the tensors, in offset order, tile the data exactly (no overlap, no gap, nothing past
    the end). Two tensors sharing bytes would otherwise load as wrong weights without a word."""
    path = Path(path)
    if not path.is_file():
        raise MiniLLMError(f"{path}: file not found")
    size = path.stat().st_size
    if size < 8:
        raise MiniLLMError(f"{path}: not a safetensors file (only {size} bytes)")
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > size - 8:
            raise MiniLLMError(f"{path}: header length {header_len} runs past the end of the "
                               f"{size}-byte file (truncated or not safetensors)")
        if header_len > MAX_HEADER_BYTES:
            raise MiniLLMError(f"{path}: header of {header_len} bytes (safetensors allows {MAX_HEADER_BYTES})")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise MiniLLMError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise MiniLLMError(f"{path}: header is not a JSON object")
    header.pop("__metadata__", None)

    data_start = 8 + header_len
    entries = {name: _header_entry(path, name, info) for name, info in header.items()}
    _check_layout(path, entries, data_start, size)
    mm = np.memmap(path, dtype=np.uint8, mode="r") if size > data_start else np.zeros(0, np.uint8)
    return {name: np.ndarray(shape, dtype=dtype, buffer=mm, offset=data_start + begin)
            for name, (dtype, shape, begin, _) in entries.items()}


def _header_entry(path: Path, name: str, info: Any) -> tuple[np.dtype, tuple[int, ...], int, int]:
    """One header entry -> (dtype, shape, begin, end), its sizes non-negative integers that agree."""
    try:
        dtype, shape, offsets = np.dtype(_ST_TO_NP[info["dtype"]]), info["shape"], info["data_offsets"]
    except (KeyError, TypeError):
        raise MiniLLMError(f"{path}: bad header entry for tensor {name}: {str(info)[:200]}") from None
    if not (isinstance(shape, list) and isinstance(offsets, list) and len(offsets) == 2 and
            all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in [*shape, *offsets])):
        raise MiniLLMError(f"{path}: bad header entry for tensor {name}: shape and data_offsets must be "
                           f"non-negative integers ({str(info)[:200]})")
    begin, end = offsets
    n_bytes = math.prod(shape) * dtype.itemsize        # Python integers: a lying shape cannot overflow
    if end - begin != n_bytes:
        raise MiniLLMError(f"{path}: tensor {name} has {end - begin} bytes, its shape {tuple(shape)} needs {n_bytes}")
    return dtype, tuple(shape), begin, end


def _check_layout(path: Path, entries: dict[str, tuple], data_start: int, size: int) -> None:
    """The tensors, ordered by offset, cover the data bytes (data_start to the end) exactly once."""
    at, previous = 0, None
    for name, (_, _, begin, end) in sorted(entries.items(), key=lambda item: item[1][2:]):
        if begin < at:
            raise MiniLLMError(f"{path}: tensors {previous} and {name} overlap (bytes {begin} to {at}): "
                               "each tensor needs its own bytes")
        if begin > at:
            raise MiniLLMError(f"{path}: {begin - at} bytes before tensor {name} belong to no tensor "
                               "(a gap in data_offsets)")
        at, previous = end, name
    if data_start + at > size:
        raise MiniLLMError(f"{path}: truncated: tensor {previous} ends at byte {data_start + at}, "
                           f"the file has {size}")
    if data_start + at < size:
        raise MiniLLMError(f"{path}: {size - data_start - at} bytes after the last tensor belong to no tensor")


# ---- safetensors: write ---------------------------------------------------------------------------
def _is_float(a: np.ndarray) -> bool:
    return a.dtype.kind == "f" or a.dtype == np.uint16  # uint16 = bf16 bits


def _castable(name: str, a: np.ndarray) -> bool:
    """A float weight that `dtype=` may cast; quantized tensors (quant.py) keep their exact dtypes."""
    return _is_float(a) and not name.endswith(QUANT_SUFFIXES)


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], dtype: str | None = None,
                      progress: bool = False) -> None:
    """Write tensors to one .safetensors file (uint16 is written as BF16).

    `dtype` ("float32" | "float16" | "bfloat16") casts float tensors one at a time as they are
    written, so a model is never held twice in memory.
    """
    target = np.dtype(STORAGE_DTYPES[dtype]) if dtype else None
    if dtype and target is None:
        raise MiniLLMError(f"unknown dtype {dtype!r}: use float32, float16 or bfloat16")
    cast = {name for name, a in tensors.items() if dtype and _castable(name, a)}
    specs = {name: (target if name in cast else a.dtype, a.shape) for name, a in tensors.items()}
    write_safetensors_stream(path, specs, lambda name: to_dtype(tensors[name], dtype) if name in cast
                             else tensors[name], progress)


def write_safetensors_stream(path: str | Path, specs: dict[str, tuple[np.dtype, tuple[int, ...]]],
                             produce: Callable[[str], np.ndarray], progress: bool = False) -> None:
    """Write a .safetensors file whose tensors are made one at a time: the header comes from
    `specs` {name: (dtype, shape)}, then `produce(name)` is called for each name in order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}  # transformers wants format=pt
    offset = 0
    for name, (dtype, shape) in specs.items():
        key = np.dtype(dtype).newbyteorder("<").str
        if key not in _NP_TO_ST:
            raise MiniLLMError(f"cannot write tensor {name}: dtype {dtype} has no safetensors equivalent")
        n_bytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": _NP_TO_ST[key], "shape": list(shape), "data_offsets": [offset, offset + n_bytes]}
        offset += n_bytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # pad so the data (and so every tensor) starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in tqdm(specs, total=len(specs), desc=f"writing {Path(path).name}",
                         unit="tensor", disable=not progress):
            a = produce(name)
            dtype, shape = specs[name]
            if a.dtype != dtype or a.shape != tuple(shape):
                raise MiniLLMError(f"tensor {name}: made {a.dtype} {a.shape}, declared {dtype} {tuple(shape)}")
            f.write(np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).data)


# ---- HF directories -------------------------------------------------------------------------------
def read_config(path: str | Path) -> ModelConfig:
    """A checkpoint dir's config.json -> ModelConfig (MiniLLMError if missing, bad or unsupported)."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise MiniLLMError(f"{file}: missing (a weights dir needs config.json next to its safetensors)")
    try:
        config = ModelConfig.from_hf(translate_config(json.loads(file.read_text(encoding="utf-8"))))
    except ConfigError as e:                                    # names the field already
        raise MiniLLMError(f"{file}: {e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MiniLLMError(f"{file}: not valid JSON ({e})") from None
    except (KeyError, ValueError, TypeError) as e:
        raise MiniLLMError(f"{file}: cannot read the model shape ({type(e).__name__}: {e})") from None
    return replace(config, generation_eos_token_ids=generation_eos_ids(path))


def generation_eos_ids(path: str | Path) -> tuple[int, ...]:
    """The eos_token_id of a checkpoint dir's generation_config.json, an int or a list (() without one): the
    ids HF's generate stops on, which may be more than config.json's (GPT-OSS's <|call|> and <|return|>)."""
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return ()
    try:
        value = json.loads(file.read_text(encoding="utf-8")).get("eos_token_id")
        ids = [] if value is None else value if isinstance(value, list) else [value]
        return tuple(require_int(i, "eos_token_id", minimum=0) for i in ids)
    except ConfigError as e:
        raise MiniLLMError(f"{file}: {e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise MiniLLMError(f"{file}: not a JSON object ({e})") from None


def load_hf_dir(path: str | Path, gguf: str = "auto") -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Load an HF-layout dir: config.json plus model.safetensors or a sharded index + shards, or, with
    neither, the GGUF its weights came in (GGUF_WEIGHTS).

    Safetensors arrays are memory-mapped views in the stored dtype (bf16 as uint16); nothing is read
    until used. A GGUF's tensors load as `gguf` says (gguf_quantized.load_gguf_for_cpu): a small model's
    are dequantized to float32 here (a few seconds for SmolLM2), every time: that keeps the values exact
    at a sixth of the disk (a Q4_1 weight needs float32, not 16 bits); a large one's stay quantized.
    """
    path = Path(path)
    if not path.is_dir():
        raise MiniLLMError(f"{path}: not a directory")
    config = read_config(path)
    if (path / SAFETENSORS).is_file():
        tensors = read_safetensors(path / SAFETENSORS)
    elif (path / SAFETENSORS_INDEX).is_file():
        tensors = _load_sharded(path / SAFETENSORS_INDEX)
    elif (path / GGUF_WEIGHTS).is_file():
        _, tensors = load_gguf_for_cpu(path / GGUF_WEIGHTS, how=gguf)
    else:
        raise MiniLLMError(f"{path}: no {SAFETENSORS} or {SAFETENSORS_INDEX} (only safetensors weights are read; "
                           f"convert .bin checkpoints with transformers' save_pretrained first)")
    if (config.quantization or {}).get("block"):            # an HF fp8 checkpoint: its tensors renamed
        _check_counts(config, tensors, path)                # (quantized_matrices lists every layer's)
        tensors = translate_tensors(tensors, quantized_matrices(config))
    tensors = split_fused(config, tensors)                  # Phi-3's fused, GPT-OSS's stacked: views per matrix
    check_tensors(config, tensors, path)
    return config, tensors


# ---- the tensors a config implies ------------------------------------------------------------------
def _quantized_shapes(c: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The same with each layer matrix P.weight stored as quant.py writes it: P.qweight, P.scales (, P.mins)."""
    out = {}
    group = c.quantization.get("group_size", 0)
    quantized = quantized_matrices(c)
    for name, shape in shapes.items():
        if not (name.endswith(".weight") and name.removesuffix(".weight") in quantized):
            out[name] = shape
            continue
        p, (rows, cols) = name.removesuffix(".weight"), shape
        if c.quantization["method"] == "int8":
            out |= {p + ".qweight": shape, p + ".scales": (rows,)}
        elif c.quantization["method"] in FORMATS:        # fp8, nf4, mxfp4
            out |= {p + suffix: s for suffix, s in stored_shapes(c.quantization, shape).items()}
        else:
            groups = -(-cols // group)
            out |= {p + ".qweight": (rows, groups * group // 2), p + ".scales": (rows, groups), p + ".mins": (rows, groups)}
    return out


# Tensors some checkpoints carry that change nothing: RoPE's frequencies are computed, not loaded.
_IGNORABLE = ("rotary_emb.inv_freq",)
# Tensors a checkpoint may leave out: an MLA latent without its norm is linear (mla_convert writes none).
_OPTIONAL = ("self_attn.kv_a_layernorm.weight",)


def check_tensors(config: ModelConfig, tensors: dict[str, np.ndarray], where: str | Path) -> None:
    """Every tensor the config implies is present, with its shape and a float dtype; nothing that would
    change the math (a bias, a norm, a layer the config does not declare) is left over. MiniLLMError otherwise.

    Checks the header's shapes only: nothing is read from the files."""
    _check_counts(config, tensors, where)
    shapes = expected_shapes(config)
    if config.quantization:
        shapes = _quantized_shapes(config, shapes)
    for name, shape in shapes.items():
        if name not in tensors and name.endswith(_OPTIONAL):
            continue
        if name not in tensors:
            hint = " (tie_word_embeddings is false: an untied model needs its LM head)" if name == "lm_head.weight" else ""
            raise MiniLLMError(f"{where}: tensor {name} is missing{hint}")
        a = tensors[name]
        if tuple(a.shape) != shape:
            raise MiniLLMError(f"{where}: tensor {name} has shape {tuple(a.shape)}, config.json implies {shape} "
                               f"({_fields_of(config, name, shape, tuple(a.shape))})")
        if not name.endswith(QUANT_SUFFIXES) and not isinstance(a, QuantizedWeight) and not _is_float(a):
            raise MiniLLMError(f"{where}: tensor {name} has dtype {a.dtype}, expected a float type")
    if config.tie_embeddings and "lm_head.weight" in tensors:   # a tied head's copy: HF ignores it, if it is one
        _check_tied_copy(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"], where)
    extra = sorted(n for n in tensors if n not in shapes and not n.endswith(_IGNORABLE)
                   and not (n == "lm_head.weight" and config.tie_embeddings))
    if extra:
        why = ("a bias config.json does not declare (attention_bias / mlp_bias are false)" if extra[0].endswith(".bias")
               else f"not part of a {config.family} model of this config (minillm would ignore it)")
        raise MiniLLMError(f"{where}: tensor {extra[0]} is {why}" + (f"; {len(extra) - 1} more" if len(extra) > 1 else ""))


def _check_counts(config: ModelConfig, tensors: dict[str, np.ndarray], where) -> None:
    """The config's layer and expert counts are those the tensor names number: checked before anything
    loops over them, so a config.json claiming 2^31 layers is refused at once."""
    mismatch = hf_count_mismatch(config, tensors)
    if mismatch:
        raise MiniLLMError(f"{where}: {mismatch}")


def _check_tied_copy(head: np.ndarray, embed: np.ndarray, where) -> None:
    """tie_word_embeddings=true with an lm_head.weight that is not the embedding is an untied model
    mislabeled: tying would throw its head away. Sixteen rows tell (reading all would page in both)."""
    rows = np.unique(np.linspace(0, len(embed) - 1, 16).astype(np.int64))
    if head.shape != embed.shape or not np.array_equal(head[rows], embed[rows]):
        raise MiniLLMError(f"{where}: config.json says tie_word_embeddings=true, but lm_head.weight is not a copy "
                           "of the embedding (set tie_word_embeddings to false if the model has its own LM head)")


def _fields_of(c: ModelConfig, name: str, expected: tuple[int, ...], found: tuple[int, ...]) -> str:
    """Which config.json fields set the dimensions that differ, for the error message."""
    heads = {c.n_kv_heads * c.head_dim: "num_key_value_heads x head_dim",
             c.n_heads * c.head_dim: "num_attention_heads x head_dim"}
    if ".k_proj." in name or ".v_proj." in name:
        heads = dict(reversed(heads.items()))
    mlp = {c.ffn_dim: "intermediate_size"}
    # Later entries win when two fields have the same value: the ones this tensor's kind is made of.
    names = (mlp | heads if "self_attn" in name else heads | mlp) | {c.vocab_size: "vocab_size", c.dim: "hidden_size"}
    wrong = [names.get(e, f"dimension {i}") for i, (e, f) in enumerate(zip(expected, found)) if e != f]
    return "check " + ", ".join(wrong) if wrong and len(expected) == len(found) else "check the config's sizes"


def _load_sharded(index_file: Path) -> dict[str, np.ndarray]:
    """Follow model.safetensors.index.json's weight_map {tensor name: shard file} to every shard."""
    try:
        weight_map = json.loads(index_file.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise MiniLLMError(f"{index_file}: not a valid safetensors index ({type(e).__name__}: {e})") from None
    tensors: dict[str, np.ndarray] = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = index_file.parent / shard
        if not shard_path.is_file():
            raise MiniLLMError(f"{shard_path}: shard listed in {index_file.name} is missing")
        shard_tensors = read_safetensors(shard_path)
        twice = sorted(set(shard_tensors) & set(tensors))
        if twice:                                       # which copy is the weight? neither, without a word
            raise MiniLLMError(f"{shard_path}: tensor {twice[0]} is also in another shard")
        tensors.update(shard_tensors)
    missing = sorted(set(weight_map) - set(tensors))
    if missing:
        raise MiniLLMError(f"{index_file}: {len(missing)} tensors listed but not in their shards, e.g. {missing[0]}")
    return tensors


# Files besides the weights that make a converted checkpoint usable as a model, copied along by every
# HF-dir conversion (not source.gguf: that is the original model and would no longer describe this one).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")


def copy_tokenizer_files(src: Path, dst: Path) -> None:
    """The tokenizer, its config and chat template, and the generation config, from src into dst."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)


def save_hf_dir(path: str | Path, config: ModelConfig, tensors: dict[str, np.ndarray],
                tokenizer: Any = None, dtype: str | None = None, progress: bool = False) -> Path:
    """Write an HF-layout dir that `load_hf_dir` and transformers' `from_pretrained` both read.

    `dtype` ("float32" | "float16" | "bfloat16") casts every tensor on the way out; without it each
    tensor keeps its dtype (uint16 = bf16). config.json is written last, so its presence means the
    dir is complete. A tied LM head is not written (HF re-ties it from the embeddings).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if config.tie_embeddings:
        tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    # config.json's torch_dtype tells transformers what to load as: make it say what we store.
    config = config.replace(torch_dtype=dtype or _stored_dtype(tensors, config.torch_dtype))
    write_safetensors(path / SAFETENSORS, tensors, dtype, progress)
    if tokenizer is not None:
        save_hf(tokenizer, path)
    (path / "config.json").write_text(json.dumps(config.to_hf(), indent=2) + "\n")
    return path


def _stored_dtype(tensors: dict[str, np.ndarray], default: str) -> str:
    """The dtype name of the first weight matrix ("bfloat16" for uint16 bits)."""
    names = {np.dtype(v): k for k, v in STORAGE_DTYPES.items()}
    for name, a in tensors.items():
        if a.ndim == 2 and a.dtype in names and name.endswith(".weight"):
            return names[a.dtype]
    return default
