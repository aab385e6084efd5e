"""Weight-only quantization: int8 per output channel, int4 in groups, and the linear that reads them.

Decode reads every weight once per token, so its speed is bytes / bandwidth: fewer bytes per
weight is the lever. int8 halves bf16's bytes, int4 quarters them (plus a little for scales).

int8, symmetric per output channel (one fp32 scale per row of W [out, in]):

    scale[r] = max_j |W[r, j]| / 127        q = round(W / scale) in [-127, 127]     W ≈ q · scale

int4, asymmetric in groups of `group_size` consecutive inputs of a row (a scale and a min each, fp16):

    scale = (max - min) / 15                q = round((W - min) / scale) in [0, 15]  W ≈ q · scale + min

Why asymmetric for int4: with only 16 levels, a symmetric grid (q in [-7, 7], scale = max|W| / 7)
spends levels on the side of zero the group does not reach and uses 15 of its 16 codes; the
asymmetric grid fits [min, max] exactly. Measured on SmolLM2-135M's layer matrices, groups of 128:
relative RMS weight error 0.100 asymmetric vs 0.125 symmetric (int8: 0.0085), and mean NLL over
1024 tokens of evaluate.eval_text() +15.5% asymmetric vs +18.9% symmetric over fp32 (int8: +0.1%;
int4 groups of 64: +9.7%). SmolLM2 is a hard case: its weights come from a Q4_1 GGUF, already
4-bit in groups of 32, which groups of 128 round a second time; int4 in groups of 32 gives those
weights back exactly (Q4_1 is this very grid). A min costs 2 bytes a group (1/8 bit a weight at
g=128). Both fp16 values are rounded so that min16 <= min and min16 + 15·scale16 >= max: every
weight stays on the grid and its error is at most scale / 2.

The int4 layout (what a CUDA kernel will stream), for W [out, in], groups of g (a multiple of 32):

    in_padded = ceil(in / g) · g           the last group of a row is padded by repeating its last
                                           weight (the group's range does not change); the padded
                                           columns are dropped on dequantize
    qweight   uint8 [out, in_padded / 2]   row-major; byte j of a row = element 2j   (low nibble)
                                                                      | element 2j+1 (high nibble) << 4
    scales    fp16  [out, in_padded / g]   group k of row r covers elements k·g ... k·g + g - 1
    mins      fp16  [out, in_padded / g]

        row r:  byte 0      byte 1      ...  byte 15     | byte 16 ...   (one 16-byte load =
                [e1 | e0]   [e3 | e2]        [e31 | e30] | [e33 | e32]    32 weights of one row)
                 hi   lo     hi   lo          hi    lo

    A row is in_padded / 2 bytes, a multiple of 16, so every row and every group starts 16-byte
    aligned (g = 128: a group is 64 bytes, four 16-byte loads, sharing one scale and one min).

Checkpoint tensors: each quantized matrix `P.weight` is stored as `P.qweight` (int8 [out, in] or the
packed uint8 above), `P.scales` (fp32 [out] for int8, fp16 [out, groups] for int4) and, int4 only,
`P.mins`; config.json gets {"quantization": {"method": "int4", "group_size": 128}}. Quantized are the
seven matrices of each layer (q, k, v, o, gate, up, down). The embedding and the LM head keep their
stored dtype: the embedding is a lookup (one row per token, no matmul to speed up), and the head
turns the last hidden state straight into logits, where its errors are not averaged away by later
layers (GPTQ and AWQ keep it too). Measured on SmolLM2 (tied head, 256 tokens): quantizing the head
as well moves the NLL from +0.14% to +0.21% at int8 and from +15.7% to +19.9% at int4 g128, for
113 MB of fp32 saved out of 538. Convert with dtype="bfloat16" to halve the head instead.

CPU speed, honestly: NumPy has no int8 or int4 matrix product, so `QuantizedWeight.matmul` widens
a block of rows to fp32 (a few MB, so the whole fp32 matrix never exists) and multiplies that.
Widening costs more time than the saved bytes give back. SmolLM2 decode on this shared 2-core
machine, one BLAS thread, CPU time per token: fp32 25 tok/s, int8 12-15 tok/s, int4 g128 2-3 tok/s
(unpacking nibbles takes three more array passes than int8's one cast). The win on the CPU is
memory: a Mistral-7B-shaped model decodes in 8.2 GB peak RSS as int8, 5.0 GB as int4 (bf16:
14.5 GB). The speed win needs a kernel that reads the narrow bytes directly (kernels/).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .backend import as_f32
from .config import ModelConfig
from .errors import MiniLLMError

METHODS = ("int8", "int4")
GROUP_SIZES = (32, 64, 128)
BLOCK_BYTES = 4 << 20          # fp32 bytes widened at a time by `QuantizedWeight.matmul`
SUFFIXES = (".qweight", ".scales", ".mins")   # the checkpoint tensors of a quantized matrix

# The matrices of each layer that get quantized, and which model width is their input.
LAYER_MATRICES = {"self_attn.q_proj": "dim", "self_attn.k_proj": "dim", "self_attn.v_proj": "dim",
                  "self_attn.o_proj": "attn", "mlp.gate_proj": "dim", "mlp.up_proj": "dim",
                  "mlp.down_proj": "ffn"}


class QuantizedWeight:
    """A weight matrix W [out, in] stored narrow; `layers.linear` calls `matmul` on it."""
    shape: tuple[int, int]

    def dequantize_rows(self, start: int, stop: int) -> np.ndarray:
        """W[start:stop] in fp32.   -> [stop - start, in]"""
        raise NotImplementedError

    def tensors(self, prefix: str) -> dict[str, np.ndarray]:
        """The checkpoint tensors for the matrix named `prefix` (e.g. `model.layers.0.mlp.up_proj`)."""
        raise NotImplementedError

    def dequantize(self) -> np.ndarray:
        return self.dequantize_rows(0, self.shape[0])

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """x @ Wᵀ, widening BLOCK_BYTES of rows to fp32 at a time.    x: [T, in] -> [T, out]"""
        out_dim, in_dim = self.shape
        rows = max(1, BLOCK_BYTES // (4 * in_dim))
        y = np.empty((x.shape[0], out_dim), dtype=np.float32)
        for start in range(0, out_dim, rows):
            stop = min(start + rows, out_dim)
            y[:, start:stop] = x @ self.dequantize_rows(start, stop).T   # the hot spot at decode
        return y

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.tensors("").values())


@dataclass
class Int8Weight(QuantizedWeight):
    qweight: np.ndarray   # int8 [out, in]
    scales: np.ndarray    # fp32 [out]

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape

    def dequantize_rows(self, start: int, stop: int) -> np.ndarray:
        return self.qweight[start:stop].astype(np.float32) * self.scales[start:stop, None]

    def tensors(self, prefix: str) -> dict[str, np.ndarray]:
        return {prefix + ".qweight": self.qweight, prefix + ".scales": self.scales}


@dataclass
class Int4Weight(QuantizedWeight):
    qweight: np.ndarray   # uint8 [out, in_padded / 2], two weights a byte (layout: module docstring)
    scales: np.ndarray    # fp16 [out, in_padded / group_size]
    mins: np.ndarray      # fp16 [out, in_padded / group_size]
    in_features: int      # in, before padding to whole groups

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.in_features

    @property
    def group_size(self) -> int:
        return 2 * self.qweight.shape[1] // self.scales.shape[1]

    def dequantize_rows(self, start: int, stop: int) -> np.ndarray:
        q = unpack_int4(self.qweight[start:stop])                          # uint8 [rows, in_padded]
        groups = q.reshape(q.shape[0], -1, self.group_size).astype(np.float32)   # [rows, groups, g]
        scales = self.scales[start:stop, :, None].astype(np.float32)       # [rows, groups, 1]
        mins = self.mins[start:stop, :, None].astype(np.float32)
        w = groups * scales + mins                                         # [rows, groups, g]
        return w.reshape(q.shape[0], -1)[:, :self.in_features]             # [rows, in]

    def tensors(self, prefix: str) -> dict[str, np.ndarray]:
        return {prefix + ".qweight": self.qweight, prefix + ".scales": self.scales, prefix + ".mins": self.mins}


# ---- quantizing one matrix -------------------------------------------------------------------------
def quantize_int8(w: np.ndarray) -> Int8Weight:
    """Symmetric int8, one scale per output row.   w: [out, in] any float dtype (uint16 = bf16)"""
    w = as_f32(w)
    scales = np.abs(w).max(axis=1) / 127.0                                  # [out]
    safe = np.where(scales > 0, scales, 1.0).astype(np.float32)             # an all-zero row stays 0
    q = np.clip(np.rint(w / safe[:, None]), -127, 127).astype(np.int8)      # [out, in]
    return Int8Weight(q, scales.astype(np.float32))


def quantize_int4(w: np.ndarray, group_size: int = 128) -> Int4Weight:
    """Asymmetric int4 in groups of `group_size` along the input, packed two a byte (module docstring)."""
    if group_size <= 0 or group_size % 32:
        raise MiniLLMError(f"int4 group size must be a multiple of 32 (e.g. {GROUP_SIZES}), got {group_size}")
    w = as_f32(w)
    out_dim, in_dim = w.shape
    w = np.pad(w, ((0, 0), (0, -in_dim % group_size)), mode="edge")       # [out, in_padded]
    groups = w.reshape(out_dim, -1, group_size)                            # [out, groups, g]
    lo, hi = groups.min(axis=-1), groups.max(axis=-1)                      # [out, groups]
    # Round min down and scale up to fp16, so that [min16, min16 + 15·scale16] still covers [lo, hi].
    mins = lo.astype(np.float16)
    mins = np.where(mins.astype(np.float32) > lo, np.nextafter(mins, np.float16(-np.inf)), mins)
    scales = ((hi - mins.astype(np.float32)) / 15.0).astype(np.float16)
    short = mins.astype(np.float32) + 15.0 * scales.astype(np.float32) < hi
    scales = np.where(short, np.nextafter(scales, np.float16(np.inf)), scales)
    s, m = scales.astype(np.float32)[..., None], mins.astype(np.float32)[..., None]
    q = np.rint((groups - m) / np.where(s > 0, s, 1.0))                    # [out, groups, g]
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(out_dim, -1)            # [out, in_padded]
    return Int4Weight(pack_int4(q), scales, mins, in_dim)


def quantize(w: np.ndarray, method: str, group_size: int = 128) -> QuantizedWeight:
    """quantize_int8 or quantize_int4 by name."""
    if method == "int8":
        return quantize_int8(w)
    if method == "int4":
        return quantize_int4(w, group_size)
    raise MiniLLMError(f"unknown quantization {method!r}; choose one of {', '.join(METHODS)}")


def pack_int4(q: np.ndarray) -> np.ndarray:
    """[rows, n] values 0..15 (n even) -> [rows, n / 2] bytes: element 2j low nibble, 2j+1 high."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """The inverse of pack_int4.   [rows, n / 2] uint8 -> [rows, n] values 0..15"""
    q = np.empty((packed.shape[0], packed.shape[1], 2), dtype=np.uint8)
    q[..., 0] = packed & 0x0F
    q[..., 1] = packed >> 4
    return q.reshape(packed.shape[0], -1)


# ---- whole checkpoints -----------------------------------------------------------------------------
def _check(config: ModelConfig, method: str, group_size: int) -> None:
    if method not in METHODS:
        raise MiniLLMError(f"unknown quantization {method!r}; choose one of {', '.join(METHODS)}")
    if method == "int4" and (group_size <= 0 or group_size % 32):
        raise MiniLLMError(f"int4 group size must be a multiple of 32 (e.g. {GROUP_SIZES}), got {group_size}")
    if config.attention != "gqa":
        raise MiniLLMError("quantization supports Llama-style (GQA) attention only, not MLA")


def quantization_entry(method: str, group_size: int) -> dict:
    """What config.json's "quantization" says."""
    return {"method": method, "group_size": group_size} if method == "int4" else {"method": method}


def quantize_checkpoint(config: ModelConfig, tensors: dict[str, np.ndarray], method: str,
                        group_size: int = 128, progress: bool = False) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Quantize every layer matrix of an HF-named checkpoint, one tensor at a time.

    The other tensors (norms, embedding, LM head) pass through untouched. Only one matrix is ever
    widened to fp32 at once, so memory holds the (memory-mapped) source plus the quantized result.
    """
    from tqdm.auto import tqdm

    _check(config, method, group_size)
    if config.quantization:
        raise MiniLLMError(f"this checkpoint is already quantized ({config.quantization}); "
                           f"quantize the original weights instead")
    out: dict[str, np.ndarray] = {}
    for name, a in tqdm(tensors.items(), desc=f"quantizing to {method}", unit="tensor", disable=not progress):
        prefix = name.removesuffix(".weight")
        if name.startswith("model.layers.") and prefix.split(".", 3)[3] in LAYER_MATRICES:
            out.update(quantize(a, method, group_size).tensors(prefix))
        else:
            out[name] = a
    return config.replace(quantization=quantization_entry(method, group_size)), out


def gather(config: ModelConfig, tensors: dict[str, np.ndarray]) -> dict:
    """The inverse naming: each `P.qweight`/`P.scales`(/`P.mins`) group becomes one QuantizedWeight
    under `P.weight`, wrapping the stored arrays (no copy, nothing re-quantized)."""
    if not config.quantization:
        return tensors
    method = config.quantization.get("method")
    if method not in METHODS:
        raise MiniLLMError(f"config.json: unknown quantization method {method!r}")
    width = {"dim": config.dim, "attn": config.n_heads * config.head_dim, "ffn": config.ffn_dim}
    out = {k: v for k, v in tensors.items() if not k.endswith(SUFFIXES)}
    for i in range(config.n_layers):
        for part, in_kind in LAYER_MATRICES.items():
            prefix = f"model.layers.{i}.{part}"
            try:
                if method == "int8":
                    w = Int8Weight(tensors[prefix + ".qweight"], tensors[prefix + ".scales"])
                else:
                    w = Int4Weight(tensors[prefix + ".qweight"], tensors[prefix + ".scales"],
                                   tensors[prefix + ".mins"], width[in_kind])
            except KeyError as e:
                raise MiniLLMError(f"quantized checkpoint is missing tensor {e.args[0]}") from None
            out[prefix + ".weight"] = w
    return out


def convert_quantized(src: str | Path, dst: str | Path, method: str, group_size: int = 128,
                      progress: bool = True) -> Path:
    """A .gguf file or HF/minillm dir -> a quantized minillm weights dir at `dst`."""
    from .gguf_import import convert
    return convert(src, dst, progress=progress, quant=method, group_size=group_size)


# ---- a random checkpoint of any shape, written one tensor at a time --------------------------------
def write_random_checkpoint(config: ModelConfig, dst: str | Path, quant: str | None = None,
                            group_size: int = 128, seed: int = 0, dtype: str = "bfloat16",
                            progress: bool = False) -> Path:
    """Write a random-weight checkpoint of `config`'s shape into `dst`, quantized or in `dtype`.

    Proves that a model of a real size loads and runs in a given RAM without its weights: at most
    one tensor is in memory while writing. Quantized matrices get random codes and plausible scales
    (speed and memory do not depend on the values); norms are ones, other weights N(0, 0.02²).
    """
    import json

    from .backend import STORAGE_DTYPES, to_dtype
    from .gguf_import import expected_shapes
    from .weights import SAFETENSORS, write_safetensors_stream

    if quant:
        _check(config, quant, group_size)
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    float_dtype = np.dtype(STORAGE_DTYPES[dtype])
    specs: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}
    for name, shape in expected_shapes(config).items():
        prefix = name.removesuffix(".weight")
        if quant and name.startswith("model.layers.") and prefix.split(".", 3)[3] in LAYER_MATRICES:
            out_dim, in_dim = shape
            if quant == "int8":
                specs |= {prefix + ".qweight": (np.dtype(np.int8), shape),
                          prefix + ".scales": (np.dtype(np.float32), (out_dim,))}
            else:
                n_groups = -(-in_dim // group_size)
                specs |= {prefix + ".qweight": (np.dtype(np.uint8), (out_dim, n_groups * group_size // 2)),
                          prefix + ".scales": (np.dtype(np.float16), (out_dim, n_groups)),
                          prefix + ".mins": (np.dtype(np.float16), (out_dim, n_groups))}
        else:
            specs[name] = (float_dtype, shape)

    def produce(name: str) -> np.ndarray:
        d, shape = specs[name]
        if name.endswith(".qweight"):
            return rng.integers(-127 if d == np.int8 else 0, 128 if d == np.int8 else 256, shape, dtype=d)
        if name.endswith(".scales"):     # int8 codes ±127 -> ±0.06; int4 codes 0..15 -> [-0.06, 0.06]
            return np.full(shape, 0.06 / (127 if quant == "int8" else 7.5), dtype=d)
        if name.endswith(".mins"):
            return np.full(shape, -0.06, dtype=d)
        if len(shape) == 1:
            return to_dtype(np.ones(shape, np.float32), dtype)
        return to_dtype(rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02), dtype)

    write_safetensors_stream(dst / SAFETENSORS, specs, produce, progress=progress)
    config = config.replace(torch_dtype=dtype, quantization=quantization_entry(quant, group_size) if quant else None)
    (dst / "config.json").write_text(json.dumps(config.to_hf(), indent=2) + "\n")
    return dst
