"""Weight-only quantization: int8 per output channel, int4 in groups, and the linear that reads them.

Decode reads every weight once per token, so its speed is bytes / bandwidth: fewer bytes per
weight is the lever. int8 halves bf16's bytes, int4 quarters them (plus a little for scales).

int8, symmetric per output channel (one fp32 scale per row of W [out, in]):

    scale[r] = max_j |W[r, j]| / 127        q = round(W / scale) in [-127, 127]     W ≈ q · scale

int4, asymmetric in groups of `group_size` consecutive inputs of a row (a scale and a min each, fp16):

    q = clip(round((W - min) / scale), 0, 15)               W ≈ q · scale + min

Why asymmetric for int4: with only 16 levels, a symmetric grid (q in [-7, 7], scale = max|W| / 7)
spends levels on the side of zero the group does not reach and uses 15 of its 16 codes; the
asymmetric grid can sit anywhere. A min costs 2 bytes a group (1/8 bit a weight at g=128).

Which grid. The simple one spans the group, min = its min and scale = (max - min) / 15
(`minmax_grid`, what exercise 09 writes); both fp16 values are rounded so that min16 <= min and
min16 + 15·scale16 >= max, so every weight is on the grid, at most scale / 2 from its value. Two
things make it wasteful. One large weight stretches the step for all 128. And the error that
matters is the layer's output error, in which weight j's error is multiplied by input j: in
SmolLM2 a few input channels carry activations thousands of times larger than the median
("massive activations"; in the last layer's down projection the top channel's mean square is
6000× the median), so an error there costs thousands of times more. `search_grid` therefore picks,
per group, the (scale, min) that minimizes

    Σ_j a_j · (w_j - ŵ_j)²        a_j = E[x_j²], the mean square of input column j

(the diagonal of the inputs' second moments: llama.cpp calls it the importance matrix). For fixed
codes the best (scale, min) is a 2×2 weighted least-squares solve; the search tries 17 candidate
codings (grids from the group's min, steps from span/11 to span/19), refits each, keeps the best,
then alternates nearest codes and refits (Lloyd, up to 5 rounds) until nothing improves. It keeps
min/max's grid where nothing beats it, so a group min/max already represents exactly stays exact.
`quantize_checkpoint` measures a_j with `input_importance`: 2048 random token ids through the
fp32 model (which channels are large is the model's property, not the text's; random ids and
Python docstrings as calibration text gave the same perplexity within noise, and no evaluation
text can leak into the quantizer).

What clipping does to the error bound: the search may choose a grid narrower than [min, max]. A
weight inside [min16, min16 + 15·scale16] still errs by at most scale16 / 2; one outside is stored
as the nearest end, so its error is exactly its distance to that end (at least that, at most that
plus nothing: the tests pin both).

Weighting the search by the inputs' importance is what makes int4 g128 usable: on SmolLM2 it
leaves a fraction of a min/max grid's perplexity change. GPTQ-style error feedback (which moves
codes off their nearest value) was measured and is not done here. SmolLM2 is a hard case: its
weights come from a Q4_1 GGUF, already 4-bit in groups of 32 (this very grid, which int4 g32 gives
back exactly), so groups of 64 and 128 round them a second time. The measurements, and what
quantizing costs in time: lessons/BENCHMARKS.md, "Weight formats".

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
layers (GPTQ and AWQ keep it too); on SmolLM2 quantizing it costs more perplexity than its bytes are
worth (lessons/BENCHMARKS.md, "Weight formats"). Convert with dtype="bfloat16" to halve the head instead.

CPU speed, honestly: NumPy has no int8 or int4 matrix product, so the matmuls widen a block of rows
to fp32 (a few MB, so the whole fp32 matrix never exists) and run the fp32 GEMM on it. What is
left to choose is how little else touches every weight: int8 applies each row's scale to its one
output, and int4 at decode works group by group (s·Σq·x + m·Σx, the two nibbles of a byte against
x's even and odd elements), so the codes are only cast, never scaled or interleaved. On one BLAS
thread that makes int8 decode faster than fp32 (a quarter of the bytes from DRAM); the win on the
CPU is still mostly memory, and the speed win needs a kernel that reads the narrow bytes directly
(kernels/). Speeds and memory: lessons/BENCHMARKS.md, "Narrow weights on the CPU".
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from minillm.backend import as_f32, blockwise_matmul
from minillm.model.config import ModelConfig
from minillm.errors import MiniLLMError

METHODS = ("int8", "int4", "fp8", "nf4", "mxfp4")   # the last three: low-bit float formats (formats.py)
GROUP_SIZES = (32, 64, 128)
BLOCK_BYTES = 4 << 20          # fp32 bytes widened at a time by `QuantizedWeight.matmul`
SUFFIXES = (".qweight", ".scales", ".mins", ".absmax")   # the checkpoint tensors of a quantized matrix
CALIBRATION_TOKENS = 2048       # random tokens run through the model before int4 (input_importance)
CALIBRATION_WINDOW = 256        # tokens per prefill, as in evaluate.perplexity's default windows

# The matrices of each layer that get quantized, and which model width is their input.
LAYER_MATRICES = {"self_attn.q_proj": "dim", "self_attn.k_proj": "dim", "self_attn.v_proj": "dim",
                  "self_attn.o_proj": "attn", "mlp.gate_proj": "dim", "mlp.up_proj": "dim",
                  "mlp.down_proj": "ffn"}
# ... and the experts of MoE layers (moe.py), each its own matrices; the router stays in float.
EXPERT_MATRIX = re.compile(r"(block_sparse_moe\.experts\.\d+\.w[123]|mlp\.(experts\.\d+|shared_experts)\.(gate|up|down)_proj)")


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
        return blockwise_matmul(x, out_dim, self.dequantize_rows, 4 * in_dim, BLOCK_BYTES)

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

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """x @ Wᵀ = (x @ qᵀ) · scale: rows widened to fp32 a block at a time, and each row's scale applied
        to its one output instead of to every weight (faster: lessons/BENCHMARKS.md, "Narrow weights on the CPU")."""
        out_dim, in_dim = self.shape
        y = blockwise_matmul(x, out_dim, lambda start, stop: self.qweight[start:stop].astype(np.float32),
                             4 * in_dim, BLOCK_BYTES)                      # x @ qᵀ: [T, out]
        y *= self.scales                                                   # [T, out] · [out]
        return y

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

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """x @ Wᵀ. For a few rows of x (decode) group by group, Σ_k (q·s + m)·x_k = s·Σ q·x + m·Σ x: the
        scale and min then multiply one number per row and group, not every weight, and a byte's two
        nibbles meet x's even and odd elements, so the codes are never interleaved (faster for one token:
        lessons/BENCHMARKS.md, "Narrow weights on the CPU"). For many rows (prefill), widening the weights
        once is cheaper: QuantizedWeight.matmul."""
        T = x.shape[0]
        if T >= self.group_size:
            return super().matmul(x)
        out_dim, g = self.shape[0], self.group_size
        n_groups = self.scales.shape[1]
        padded = np.zeros((T, n_groups * g), dtype=np.float32)
        padded[:, :self.in_features] = x                                   # padding columns meet x = 0
        xg = padded.reshape(T, n_groups, g)                                # [T, G, g]
        x_even = xg[:, :, 0::2].transpose(1, 2, 0)                         # [G, g/2, T]: the low nibbles' x
        x_odd = xg[:, :, 1::2].transpose(1, 2, 0)                          # [G, g/2, T]: the high nibbles'
        x_sums = xg.sum(axis=2)                                            # [T, G]
        rows = max(1, BLOCK_BYTES // (4 * n_groups * g))
        y = np.empty((T, out_dim), dtype=np.float32)
        for start in range(0, out_dim, rows):
            stop = min(start + rows, out_dim)
            packed = self.qweight[start:stop].reshape(stop - start, n_groups, g // 2).transpose(1, 0, 2)
            dots = ((packed & 0x0F).astype(np.float32) @ x_even             # [G, rows, T]: Σ q·x per group
                    + (packed >> 4).astype(np.float32) @ x_odd)
            scales = self.scales[start:stop].T.astype(np.float32)[:, :, None]     # [G, rows, 1]
            y[:, start:stop] = ((dots * scales).sum(axis=0).T                   # [T, rows]
                                + x_sums @ self.mins[start:stop].T.astype(np.float32))
        return y

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


def quantize_int4(w: np.ndarray, group_size: int = 128, search: bool = False,
                  importance: np.ndarray | None = None) -> Int4Weight:
    """Asymmetric int4 in groups of `group_size` along the input, packed two a byte (module docstring).

    search=False: each group's grid runs from its min to its max (exercise 09 writes this one).
    search=True (what `quantize` and the engine use): the grid found by `search_grid`, which
    minimizes the group's squared error weighted by `importance` [in] (uniform when None).
    """
    if group_size <= 0 or group_size % 32:
        raise MiniLLMError(f"int4 group size must be a multiple of 32 (e.g. {GROUP_SIZES}), got {group_size}")
    w = as_f32(w)
    out_dim, in_dim = w.shape
    w = np.pad(w, ((0, 0), (0, -in_dim % group_size)), mode="edge")       # [out, in_padded]
    groups = w.reshape(out_dim, -1, group_size)                            # [out, groups, g]
    scales, mins = minmax_grid(groups)
    if search:
        weights = np.ones(in_dim, np.float32) if importance is None else np.asarray(importance, np.float32)
        # The padding columns are dropped on dequantize: their error costs nothing.
        weights = np.pad(weights, (0, w.shape[1] - in_dim)).reshape(groups.shape[1:])   # [groups, g]
        scales, mins = search_grid(groups, weights, scales, mins)
    q = nearest_codes(groups, scales.astype(np.float32), mins.astype(np.float32))
    return Int4Weight(pack_int4(q.astype(np.uint8).reshape(out_dim, -1)), scales, mins, in_dim)


def minmax_grid(groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each group's grid from its min to its max.   groups: [..., g] -> fp16 scales, mins [...]

    min is rounded down and scale up to fp16, so that [min16, min16 + 15·scale16] still covers
    [min, max]: every weight is on the grid, at most scale / 2 from its code's value."""
    lo, hi = groups.min(axis=-1), groups.max(axis=-1)
    mins = lo.astype(np.float16)
    mins = np.where(mins.astype(np.float32) > lo, np.nextafter(mins, np.float16(-np.inf)), mins)
    scales = ((hi - mins.astype(np.float32)) / 15.0).astype(np.float16)
    short = mins.astype(np.float32) + 15.0 * scales.astype(np.float32) < hi
    return np.where(short, np.nextafter(scales, np.float16(np.inf)), scales), mins


def nearest_codes(groups: np.ndarray, scales: np.ndarray, mins: np.ndarray,
                  out: np.ndarray | None = None) -> np.ndarray:
    """The code 0..15 nearest to each weight, as float32.   groups: [..., g]; scales, mins: [...]"""
    out = np.subtract(groups, mins[..., None], out=out)
    out *= (1.0 / np.where(scales > 0, scales, 1.0))[..., None]
    np.rint(out, out=out)
    return np.clip(out, 0, 15, out=out)


# ---- the grid search -------------------------------------------------------------------------------
# Candidate grids start at the group's min with step span / (15 + t): t < 0 reaches past the max,
# t > 0 clips it. Each candidate's codes are refit by weighted least squares, and the refit grid is
# judged by its real error (every weight re-rounded to its nearest code); then Lloyd rounds
# (nearest codes -> refit) polish the best. These settings measured best of those tried on SmolLM2's
# perplexity (lessons/BENCHMARKS.md, "Weight formats").
SEARCH_SHIFTS = tuple(np.arange(-4.0, 4.01, 0.5))
LLOYD_ROUNDS = 5
SEARCH_BLOCK = 1 << 18          # weights per block of rows: fewer, larger blocks spend less in Python


def search_grid(groups: np.ndarray, weights: np.ndarray, scales: np.ndarray, mins: np.ndarray):
    """Per group, the (scale, min) that minimizes Σ weight·(scale·code + min - w)² over the
    candidates above; min/max's (`scales`, `mins`) is kept where nothing beats it (so a group that
    min/max represents exactly stays exact).   groups: [out, G, g], weights: [G, g] -> fp16 [out, G]

    Row blocks run on `threads.n_threads()` threads: NumPy releases the GIL in these loops."""
    from minillm.threads import n_threads, parallel_map

    row_size = groups.shape[1] * groups.shape[2]
    rows = max(1, min(SEARCH_BLOCK // row_size, -(-len(groups) // n_threads())))   # a block for every thread
    starts = range(0, len(groups), rows)
    found = parallel_map(lambda r: _GroupFit(groups[r:r + rows], weights).search(scales[r:r + rows], mins[r:r + rows]),
                         starts)
    return np.concatenate([f[0] for f in found]), np.concatenate([f[1] for f in found])


class _GroupFit:
    """Weighted least squares for the grids of a block of groups.   x: [R, G, g], weights a: [G, g]

    For fixed codes L the best (scale, min) solves a 2×2 system in five sums over the group:
    Σa, ΣaL, ΣaL², Σax, ΣaLx (the normal equations of Σ a·(scale·L + min - x)²)."""

    def __init__(self, x: np.ndarray, a: np.ndarray):
        self.x, self.a = x, a
        self.n = a.sum(axis=-1).astype(np.float64)                         # [G]
        self.sx = np.einsum("rgj,gj->rg", x, a).astype(np.float64)        # [R, G]
        lo, hi = x.min(axis=-1), x.max(axis=-1)
        span = np.where(hi > lo, hi - lo, 1.0)
        self.position = (x - lo[..., None]) / span[..., None]              # 0 at the min, 1 at the max  [R, G, g]
        self.codes, self.tmp = np.empty_like(x), np.empty_like(x)          # reused buffers [R, G, g]

    def search(self, scales16: np.ndarray, mins16: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """-> fp16 scales, mins [R, G]: the best candidate, where it beats the given (min/max) grid."""
        start = (scales16.astype(np.float64), mins16.astype(np.float64))
        start_error = self.error(*start)
        best = start + (start_error,)
        for t in SEARCH_SHIFTS:
            best = self.keep_better(self.codes_at(t), best)
        for _ in range(LLOYD_ROUNDS):
            before = best[2]
            best = self.keep_better(nearest_codes(self.x, *(b.astype(np.float32) for b in best[:2]), out=self.codes),
                                    best)
            if np.array_equal(best[2], before):                            # converged: the next round repeats this one
                break
        # fp16 moves the grid a little: keep the search's result only where it still wins.
        s16, m16 = best[0].astype(np.float16), best[1].astype(np.float16)
        wins = self.error(s16.astype(np.float64), m16.astype(np.float64)) < start_error
        return np.where(wins, s16, scales16), np.where(wins, m16, mins16)

    def codes_at(self, t: float) -> np.ndarray:
        """Codes on the grid from each group's min with step span / (15 + t).   -> [R, G, g]"""
        np.multiply(self.position, np.float32(15.0 + t), out=self.codes)
        np.rint(self.codes, out=self.codes)
        return np.clip(self.codes, 0, 15, out=self.codes)

    def keep_better(self, codes: np.ndarray, best: tuple) -> tuple:
        """Refit (scale, min) to `codes`; keep it where its error beats best = (scale, min, error)."""
        weighted = np.multiply(codes, self.a, out=self.tmp)                 # a·L  [R, G, g]
        sl = np.einsum("rgj->rg", weighted).astype(np.float64)             # (einsum: 4× faster than .sum here)
        sll = np.einsum("rgj,rgj->rg", weighted, codes).astype(np.float64)
        slx = np.einsum("rgj,rgj->rg", weighted, self.x).astype(np.float64)
        det = self.n * sll - sl * sl
        solvable = det > 1e-9 * self.n * sll                               # codes not all equal
        det = np.where(solvable, det, 1.0)
        scale = (self.n * slx - sl * self.sx) / det
        low = (sll * self.sx - sl * slx) / det
        usable = solvable & (scale > 0)
        scale, low = np.where(usable, scale, best[0]), np.where(usable, low, best[1])
        err = self.error(scale, low)
        better = usable & (err < best[2])
        return tuple(np.where(better, new, old) for new, old in zip((scale, low, err), best))

    def error(self, scale: np.ndarray, low: np.ndarray) -> np.ndarray:
        """Σ a·(scale·code + min - x)² with each weight on its nearest code.   -> [R, G]

        In units of the step: u = (x - min) / scale, code = clip(round(u)), error = scale²·(u - code)²."""
        s32 = np.where(scale > 0, scale, 1.0).astype(np.float32)          # scale 0: a constant group, exact
        u = np.subtract(self.x, low.astype(np.float32)[..., None], out=self.tmp)
        u *= (1.0 / s32)[..., None]
        codes = np.clip(np.rint(u, out=self.codes), 0, 15, out=self.codes)
        u -= codes
        np.square(u, out=u)
        return np.einsum("rgj,gj->rg", u, self.a).astype(np.float64) * np.square(scale)


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
def check_method(config: ModelConfig, method: str, group_size: int) -> None:
    if method not in METHODS:
        raise MiniLLMError(f"unknown quantization {method!r}; choose one of {', '.join(METHODS)}")
    if method == "int4" and (group_size <= 0 or group_size % 32):
        raise MiniLLMError(f"int4 group size must be a multiple of 32 (e.g. {GROUP_SIZES}), got {group_size}")
    if config.attention != "gqa":
        raise MiniLLMError("quantization supports Llama-style (GQA) attention only, not MLA")


def quantization_entry(method: str, group_size: int) -> dict:
    """What config.json's "quantization" says."""
    return {"method": method, "group_size": group_size} if method == "int4" else {"method": method}


def is_layer_matrix(name: str) -> bool:
    if not name.startswith("model.layers.") or not name.endswith(".weight"):
        return False
    part = name.removesuffix(".weight").split(".", 3)[3]
    return part in LAYER_MATRICES or EXPERT_MATRIX.fullmatch(part) is not None
