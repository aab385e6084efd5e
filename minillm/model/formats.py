"""Low-bit float weight formats beside int8/int4: fp8 (E4M3, E5M2), NF4 and MXFP4.

Decode reads every weight once per token, so bits per weight set its speed and whether a model
fits at all (GPT-OSS-120B: 240 GB in bf16, ~120 GB in fp8, ~65 GB in MXFP4). int8/int4 (quant.py)
put weights on an evenly spaced grid. These three use *float* grids instead, denser near zero,
where most weights of a trained layer are:

  fp8 E4M3   8 bits: sign, 4 exponent, 3 mantissa bits; largest 448. One fp32 scale per output row
             (amax / 448), so each row's largest weight lands on the top of the grid. Relative error
             ≤ 2⁻⁴ for normal values (half a unit in the last of 3 mantissa bits). E5M2 trades a
             mantissa bit for range (largest 57344, relative error ≤ 2⁻³).            8 + 32/in bits
  NF4        4 bits: QLoRA's 16 "normal float" values, the quantiles of a normal distribution
             scaled to [-1, 1] (plus an exact zero), times each block of 64's absmax (fp32).
             Each code then holds an equal share of normally distributed weights.     4 + 32/64 = 4.5 bits
  MXFP4      4 bits: the OCP microscaling format. Elements are FP4 E2M1 (±{0, .5, 1, 1.5, 2, 3,
             4, 6}); every block of 32 shares one E8M0 scale, a bare power of two 2^e (8 bits of
             exponent, no mantissa). e = floor(log2(amax)) - 2 puts the block's largest element in
             [4, 8) · 2^e: values above 6 · 2^e clip to it (the spec's choice: a finer grid for
             the other 31 at the price of the top one).                           4 + 8/32 = 4.25 bits

The float types themselves come from ml_dtypes (NumPy dtypes for fp8/fp4/e8m0, with correct
round-to-nearest-even casts); no bit table is written by hand here. CuPy has no fp8 dtype: on the GPU
the fp8 KV cache finds each E4M3 code on the grid instead (`nearest_e4m3`: ml_dtypes' codes bit for bit).
Packing, scales and the blockwise matmul are minillm's. NF4 is a codebook, not a float type: it is built from its definition
(`nf4_codebook`) and tested against the published table.

Layouts (W [out, in]; in padded with zeros to whole blocks, the padding dropped on dequantize):
  fp8    qweight uint8 [out, in] (the fp8 bit patterns)    scales fp32 [out], or fp32 [⌈out/bo⌉, ⌈in/bi⌉]
         for block-scaled checkpoints (HF's fp8 `weight_block_size`, `block` = (bo, bi))
  nf4    qweight uint8 [out, in_padded / 2] (code 2j low nibble, 2j+1 high: as int4)   absmax fp32 [out, blocks]
  mxfp4  qweight uint8 [out, in_padded / 2] (E2M1 codes, same nibble order: GPT-OSS's)  scales uint8 [out, blocks] (E8M0)

Every matmul widens a few MB of rows to fp32 at a time (QuantizedWeight.matmul), through a table of
the format's values taken two codes at a time (`pair_table`: one gather per two weights, and NF4's and
MXFP4's packed bytes need no unpacking): the bytes in memory stay narrow. fp8 applies its row scale to
the output, as int8 does.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist

import numpy as np

from minillm.backend import array_module, as_f32, blockwise_matmul
from minillm.errors import MiniLLMError
from minillm.model.quant import BLOCK_BYTES, QuantizedWeight, pack_int4
from minillm.resources import install_hint

FORMATS = ("fp8", "nf4", "mxfp4")
FP8_KINDS = ("e4m3", "e5m2")
NF4_BLOCK = 64
MX_BLOCK = 32
E2M1_EMAX = 2                  # the largest E2M1 value is 1.5 · 2²


def ml_dtypes():
    """The ml_dtypes module, or a one-line error saying how to get it."""
    try:
        import ml_dtypes as module
    except ImportError:
        raise MiniLLMError(f"the fp8/nf4/mxfp4 formats need ml_dtypes: {install_hint('formats')}") from None
    return module


def float_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a narrow float: e4m3 (fn: no inf, largest 448), e5m2, e2m1, e8m0."""
    m = ml_dtypes()
    return np.dtype({"e4m3": m.float8_e4m3fn, "e5m2": m.float8_e5m2, "e2m1": m.float4_e2m1fn,
                     "e8m0": m.float8_e8m0fnu}[name])


@lru_cache(maxsize=None)
def value_table(name: str, xp=np) -> np.ndarray:
    """fp32 value of every bit pattern of a narrow float (16 for e2m1, 256 for the 8-bit ones), made with
    ml_dtypes on the host and, for xp=cupy, uploaded once: decoding is then `table[codes]` on either."""
    n = 16 if name == "e2m1" else 256
    values = np.arange(n, dtype=np.uint8).view(float_dtype(name)).astype(np.float32)
    return values if xp is np else xp.asarray(values)


@lru_cache(maxsize=None)
def pair_table(name: str) -> np.ndarray:
    """Two codes at once: float64 entries whose bytes are the fp32 values of a pair of codes, so one
    gather widens two weights (twice as fast as a gather per weight here). "e4m3"/"e5m2": indexed by
    two consecutive fp8 bytes read as one uint16 (little-endian: the first byte is the low one), 65,536
    entries; "e2m1"/"nf4": indexed by one packed byte (low nibble first), 256 entries.
    -> float64 [n], to `.view(np.float32)` after the gather"""
    values = nf4_values() if name == "nf4" else value_table(name)
    width = 8 if name in FP8_KINDS else 4
    index = np.arange(1 << (2 * width))
    lo, hi = index & ((1 << width) - 1), index >> width
    return np.stack([values[lo], values[hi]], axis=-1).astype(np.float32).view(np.float64).ravel()


def widen_pairs(codes: np.ndarray, name: str) -> np.ndarray:
    """fp32 values of fp8 codes [rows, n] (n even), or of packed nibble bytes [rows, n / 2].  -> [rows, n]"""
    index = np.ascontiguousarray(codes)
    if name in FP8_KINDS:
        index = index.view(np.uint16)                                     # two fp8 codes an index
    return np.take(pair_table(name), index).view(np.float32)


def float_grid(name: str) -> np.ndarray:
    """Every finite value the format can hold, sorted and unique (the grid lesson 23 draws)."""
    v = value_table(name)
    return np.unique(v[np.isfinite(v)])


def largest(name: str) -> float:
    return float(float_grid(name)[-1])


E4M3_NAN = 0x7F                # E4M3 "fn": no infinity; 0x7F (0xFF with the sign) is its only NaN
E4M3_OVERFLOW = 464.0          # halfway from 448 to the 480 that 0x7F would have been: above it, NaN


def encode_e4m3(x):
    """fp32 -> E4M3 codes (uint8 bit patterns), rounded as ml_dtypes' cast rounds: on the host that cast,
    elsewhere (CuPy has no fp8 dtype) `nearest_e4m3`, which gives the same codes.   x [...] -> [...]"""
    xp = array_module(x)
    if xp is np:
        return np.asarray(x, dtype=np.float32).astype(float_dtype("e4m3")).view(np.uint8)
    return nearest_e4m3(x)


def nearest_e4m3(x):
    """E4M3 codes by search over the grid, in any array module: ml_dtypes' rounding, written out.

    Codes 0..126 are the non-negative finite values in ascending order, so a magnitude's code is the
    index of its nearest grid value; a tie (exactly halfway) goes to the even code, as round-to-nearest-even
    does (464 itself to 448); above 464 (±inf, NaN too) it is NaN: E4M3fn has no infinity. The sign is the
    top bit (-0 -> 0x80, -NaN -> 0xFF).
    x [...] fp32 -> [...] uint8"""
    xp = array_module(x)
    x = xp.asarray(x, dtype=xp.float32)
    magnitude = xp.abs(x)
    grid = value_table("e4m3", xp)[:E4M3_NAN]                             # [127] ascending, 0 .. 448
    halfway = (grid[1:] + grid[:-1]) / 2                                  # [126], exact in fp32
    below = xp.searchsorted(halfway, magnitude, side="left")              # the nearer of two, ties low
    above = xp.searchsorted(halfway, magnitude, side="right")             # ties high; elsewhere == below
    code = xp.where((above > below) & (below % 2 == 1), above, below)     # a tie to the even code
    code = xp.where(xp.isnan(magnitude) | (magnitude > E4M3_OVERFLOW), E4M3_NAN, code)
    return xp.where(xp.signbit(x), code + 0x80, code).astype(xp.uint8)     # the sign bit on top


def nf4_codebook() -> np.ndarray:
    """QLoRA's NF4: 8 positive quantiles of N(0, 1) and 7 negative ones, from the probability `offset`
    inwards, with an exact zero between, scaled so the extremes are ±1.   -> [16] ascending

    Asymmetric (8 positive, 7 negative) so that 0 is a code and ±1 both are. offset = (1 - 1/(2·15) +
    1 - 1/(2·16)) / 2 is where QLoRA puts the outermost quantile."""
    offset = 0.9677083
    inv = NormalDist().inv_cdf
    positive = [inv(p) for p in np.linspace(offset, 0.5, 9)[:-1]]         # 8, large to small
    negative = [-inv(p) for p in np.linspace(offset, 0.5, 8)[:-1]]        # 7
    values = np.array(sorted(positive + [0.0] + negative), dtype=np.float64)
    return (values / np.abs(values).max()).astype(np.float32)


_NF4: list[np.ndarray] = []


def nf4_values() -> np.ndarray:
    if not _NF4:
        _NF4.append(nf4_codebook())
    return _NF4[0]


def nearest_code(x: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Index of the nearest entry of the ascending `values` for each x (ties to the lower).  -> uint8"""
    midpoints = (values[1:] + values[:-1]) / 2
    return np.searchsorted(midpoints, x, side="left").astype(np.uint8)


def _padded(w: np.ndarray, block: int) -> np.ndarray:
    """[out, in] -> [out, in rounded up to whole blocks], zeros appended (a zero never raises absmax)."""
    pad = -w.shape[1] % block
    return np.pad(w, ((0, 0), (0, pad))) if pad else w


# ---- fp8 ---------------------------------------------------------------------------------------------
@dataclass
class Fp8Weight(QuantizedWeight):
    qweight: np.ndarray              # uint8 [out, in]: fp8 bit patterns
    scales: np.ndarray               # fp32 [out], or [⌈out/bo⌉, ⌈in/bi⌉] with `block`
    kind: str = "e4m3"
    block: tuple[int, int] | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape

    def codes_fp32(self, start: int, stop: int) -> np.ndarray:
        if self.qweight.shape[1] % 2 == 0:
            return widen_pairs(self.qweight[start:stop], self.kind)       # [rows, in], unscaled
        return np.take(value_table(self.kind), self.qweight[start:stop])

    def dequantize_rows(self, start: int, stop: int) -> np.ndarray:
        w = self.codes_fp32(start, stop)
        if self.block is None:
            return w * self.scales[start:stop, None]
        bo, bi = self.block
        rows = np.arange(start, stop) // bo
        per_column = np.repeat(self.scales[rows], bi, axis=1)[:, :w.shape[1]]   # [rows, in]
        return w * per_column

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """x @ Wᵀ: per-row scales meet the output, as int8's do; block scales widen with the rows."""
        if self.block is not None:
            return super().matmul(x)
        out_dim, in_dim = self.shape
        y = blockwise_matmul(x, out_dim, self.codes_fp32, 4 * in_dim, BLOCK_BYTES)   # [T, out]
        y *= self.scales
        return y

    def tensors(self, prefix: str) -> dict[str, np.ndarray]:
        return {prefix + ".qweight": self.qweight, prefix + ".scales": self.scales}


def quantize_fp8(w: np.ndarray, kind: str = "e4m3") -> Fp8Weight:
    """fp8 with one scale per output row: scale = amax / largest, codes = round(w / scale).  w: [out, in]"""
    if kind not in FP8_KINDS:
        raise MiniLLMError(f"unknown fp8 kind {kind!r}; choose e4m3 or e5m2")
    w = as_f32(w)
    scales = (np.abs(w).max(axis=1) / np.float32(largest(kind))).astype(np.float32)   # [out]
    safe = np.where(scales > 0, scales, 1.0).astype(np.float32)                      # an all-zero row stays 0
    codes = (w / safe[:, None]).astype(float_dtype(kind)).view(np.uint8)              # [out, in]
    return Fp8Weight(codes, scales, kind)


# ---- NF4 ---------------------------------------------------------------------------------------------
@dataclass
class Nf4Weight(QuantizedWeight):
    qweight: np.ndarray     # uint8 [out, in_padded / 2]
    absmax: np.ndarray      # fp32 [out, in_padded / 64]
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.in_features

    def dequantize_rows(self, start: int, stop: int) -> np.ndarray:
        values = widen_pairs(self.qweight[start:stop], "nf4").reshape(stop - start, -1, NF4_BLOCK)   # [rows, blocks, 64]
        w = values * self.absmax[start:stop, :, None]
        return w.reshape(stop - start, -1)[:, :self.in_features]            # [rows, in]

    def tensors(self, prefix: str) -> dict[str, np.ndarray]:
        return {prefix + ".qweight": self.qweight, prefix + ".absmax": self.absmax}


def quantize_nf4(w: np.ndarray) -> Nf4Weight:
    """NF4: each block of 64 divided by its absmax, each value to the nearest of the 16 codes."""
    w = as_f32(w)
    blocks = _padded(w, NF4_BLOCK).reshape(w.shape[0], -1, NF4_BLOCK)      # [out, blocks, 64]
    absmax = np.abs(blocks).max(axis=-1)                                    # [out, blocks]
    safe = np.where(absmax > 0, absmax, 1.0)
    codes = nearest_code(blocks / safe[..., None], nf4_values())            # [out, blocks, 64]
    return Nf4Weight(pack_int4(codes.reshape(w.shape[0], -1)), absmax.astype(np.float32), w.shape[1])


# ---- MXFP4 -------------------------------------------------------------------------------------------
@dataclass
class Mxfp4Weight(QuantizedWeight):
    qweight: np.ndarray     # uint8 [out, in_padded / 2]: E2M1 codes, element 2j low nibble
    scales: np.ndarray      # uint8 [out, in_padded / 32]: E8M0, the block's scale is 2^(byte - 127)
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.in_features

    def dequantize_rows(self, start: int, stop: int) -> np.ndarray:
        elements = widen_pairs(self.qweight[start:stop], "e2m1").reshape(stop - start, -1, MX_BLOCK)  # [rows, blocks, 32]
        scale = np.take(value_table("e8m0"), self.scales[start:stop])       # [rows, blocks] powers of two
        return (elements * scale[..., None]).reshape(stop - start, -1)[:, :self.in_features]

    def tensors(self, prefix: str) -> dict[str, np.ndarray]:
        return {prefix + ".qweight": self.qweight, prefix + ".scales": self.scales}


def mx_scale_exponents(blocks: np.ndarray) -> np.ndarray:
    """The OCP MX shared exponent of each block: floor(log2(amax)) - 2, in E8M0's range.  [..., 32] -> int"""
    amax = np.abs(blocks).max(axis=-1)
    exponent = np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - E2M1_EMAX
    return np.clip(np.where(amax > 0, exponent, -127), -127, 127).astype(np.int32)


def encode_mx_block(block: np.ndarray) -> tuple[np.ndarray, int]:
    """One block of 32 -> (its 32 E2M1 codes, its E8M0 scale byte): what exercise 23 asks for."""
    e = int(mx_scale_exponents(block[None])[0])
    scaled = np.clip(block.astype(np.float32) / np.float32(2.0 ** e), -6.0, 6.0)   # the clip: amax/2^e may reach 8
    return scaled.astype(float_dtype("e2m1")).view(np.uint8), e + 127


def quantize_mxfp4(w: np.ndarray) -> Mxfp4Weight:
    """MXFP4: per block of 32 a power-of-two scale 2^e, each element rounded to E2M1 (to nearest even)."""
    w = as_f32(w)
    blocks = _padded(w, MX_BLOCK).reshape(w.shape[0], -1, MX_BLOCK)        # [out, blocks, 32]
    e = mx_scale_exponents(blocks)                                          # [out, blocks]
    scaled = np.clip(blocks * np.exp2(-e.astype(np.float32))[..., None], -6.0, 6.0)
    codes = scaled.astype(float_dtype("e2m1")).view(np.uint8)               # [out, blocks, 32] values 0..15
    return Mxfp4Weight(pack_int4(codes.reshape(w.shape[0], -1)), (e + 127).astype(np.uint8), w.shape[1])


# ---- by name -----------------------------------------------------------------------------------------
def quantize_format(w: np.ndarray, method: str) -> QuantizedWeight:
    """quantize_fp8 (E4M3), quantize_nf4 or quantize_mxfp4, by name."""
    if method == "fp8":
        return quantize_fp8(w)
    if method == "nf4":
        return quantize_nf4(w)
    if method == "mxfp4":
        return quantize_mxfp4(w)
    raise MiniLLMError(f"unknown format {method!r}; choose one of {', '.join(FORMATS)}")


FORMAT_SUFFIXES = (".absmax",)    # checkpoint tensor names these formats add to quant.SUFFIXES


def from_tensors(entry: dict, tensors: dict, prefix: str, in_features: int) -> QuantizedWeight:
    """The stored tensors of matrix `prefix` -> its weight (no copy), per config.json's "quantization"."""
    method = entry["method"]
    if method == "fp8":
        block = entry.get("block")
        return Fp8Weight(tensors[prefix + ".qweight"], tensors[prefix + ".scales"], entry.get("kind", "e4m3"),
                         tuple(block) if block else None)
    if method == "nf4":
        return Nf4Weight(tensors[prefix + ".qweight"], tensors[prefix + ".absmax"], in_features)
    if method == "mxfp4":
        return Mxfp4Weight(tensors[prefix + ".qweight"], tensors[prefix + ".scales"], in_features)
    raise MiniLLMError(f"unknown format {method!r}")


def bits_per_weight(method: str, in_features: int = 4096, group_size: int = 128) -> float:
    """Stored bits per weight, scales included, for a row of `in_features` (every method minillm has)."""
    return {"fp32": 32.0, "bf16": 16.0, "int8": 8 + 32 / in_features, "int4": 4 + 32 / group_size,
            "fp8": 8 + 32 / in_features, "nf4": 4 + 32 / NF4_BLOCK, "mxfp4": 4 + 8 / MX_BLOCK}[method]


def stored_shapes(entry: dict, shape: tuple[int, int]) -> dict[str, tuple[int, ...]]:
    """Suffix -> shape of the tensors a matrix of `shape` [out, in] is stored as in this format."""
    rows, cols = shape
    method = entry["method"]
    if method == "fp8":
        block = entry.get("block")
        scales = (-(-rows // block[0]), -(-cols // block[1])) if block else (rows,)
        return {".qweight": (rows, cols), ".scales": scales}
    size = NF4_BLOCK if method == "nf4" else MX_BLOCK
    blocks = -(-cols // size)
    return {".qweight": (rows, blocks * size // 2), (".absmax" if method == "nf4" else ".scales"): (rows, blocks)}
