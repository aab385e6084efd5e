"""llama.cpp's block formats (Q8_0, Q4_K, Q6_K) as weights the model multiplies by, bytes as the file holds them.

A GGUF stores each row of a matrix W [out, in] as a run of fixed-size blocks. Every block decodes to
sub-blocks of weights on an affine grid, w = scale · code + offset, one (scale, offset) per sub-block:

  Q8_0  34 bytes per 32 weights (8.5 bits): fp16 d, then 32 int8 codes.      w = d · q
  Q4_K  144 bytes per 256 (4.5 bits): fp16 d and dmin, 12 bytes packing eight 6-bit scales sc and
        eight 6-bit mins m, then 128 bytes of nibbles. Sub-block s (32 weights) has
        w = (d · sc_s) · q - dmin · m_s. Byte j of the k-th 32-byte run holds sub-block 2k's weight j
        in its low nibble and sub-block 2k+1's weight j in its high nibble.
  Q6_K  210 bytes per 256 (6.5625 bits): 128 bytes of low 4 bits, 64 bytes of high 2 bits, sixteen
        int8 scales (one per 16 weights), fp16 d last.  w = (d · sc_s) · (q - 32), q in 0..63.

Why not int4/int8 with fp16 scales (quant.py): d · sc needs up to 19 significant bits, fp16 holds 11,
so it would round every K-quant weight a second time. Kept as the file's bytes, memory is the file's
size and every value is exactly what llama.cpp computes (the same float32 operations, in the same
order: tests/test_gguf_quantized.py checks bit equality with gguf-py's dequantize). Q4_0 and Q4_1 need
no layout of their own: they are int4 in groups of 32 with fp16 scale and min (checkpoints/gguf_quantized.py).

The matmul decodes a tile of rows at a time (a few MB), never the whole matrix. For a few rows of x
(decode) it never forms the weights: per sub-block, Σ_j w_j·x_j = scale · Σ_j q_j·x_j + offset · Σ_j x_j,
so only the codes are widened to fp32; scales and offsets multiply one number per row and sub-block.
Speeds: lessons/BENCHMARKS.md, "GGUF kept quantized".
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minillm.backend import blockwise_matmul
from minillm.model.quant import BLOCK_BYTES, QuantizedWeight

# kind -> (weights per block, bytes per block)
BLOCKS = {"Q8_0": (32, 34), "Q4_K": (256, 144), "Q6_K": (256, 210)}
SUB_BLOCK = {"Q8_0": 32, "Q4_K": 32, "Q6_K": 16}       # weights sharing one (scale, offset)
DOT_ROWS = 16       # rows of x up to which the matmul works sub-block by sub-block (decode, small batches)


def _fp16(raw: np.ndarray) -> np.ndarray:
    """Two bytes [..., 2] read as one fp16, widened to float32.   -> [...]"""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def decode_q8_0(raw: np.ndarray):
    """raw [rows, n_blocks, 34] -> codes [rows, n_blocks, 32], scale [rows, n_blocks], offset None."""
    codes = np.empty(raw.shape[:2] + (32,), np.float32)
    np.copyto(codes, raw[..., 2:].view(np.int8), casting="unsafe")          # widened in one pass
    return codes, _fp16(raw[..., 0:2]), None


def q4_k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes [..., 12] of a Q4_K block -> its eight 6-bit scales and eight 6-bit mins [..., 8].

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; bytes 8-11 hold the low 4 bits
    of scales 4-7 (low nibble) and mins 4-7 (high nibble), whose top 2 bits sit in the top 2 bits of
    bytes 0-3 (scales) and 4-7 (mins)."""
    first, second, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([first & 63, (rest & 15) | ((first >> 6) << 4)], axis=-1)
    mins = np.concatenate([second & 63, (rest >> 4) | ((second >> 6) << 4)], axis=-1)
    return scales, mins


def decode_q4_k(raw: np.ndarray):
    """raw [rows, n_blocks, 144] -> codes [rows, n_blocks * 8, 32], scale and offset [rows, n_blocks * 8]."""
    rows, n_blocks = raw.shape[:2]
    d, dmin = _fp16(raw[..., 0:2]), _fp16(raw[..., 2:4])                      # [rows, n_blocks]
    sc, m = q4_k_scales(raw[..., 4:16])                                       # [rows, n_blocks, 8]
    nibbles = raw[..., 16:].reshape(rows, n_blocks, 4, 32)                    # 4 runs of 32 bytes
    codes = np.empty((rows, n_blocks, 4, 2, 32), np.float32)                  # [.., run, low/high, j]
    # each nibble is cut out and widened to fp32 in one pass (out=): the hot loop of decode
    np.bitwise_and(nibbles, 15, out=codes[:, :, :, 0], casting="unsafe")     # sub-block 2·run
    np.right_shift(nibbles, 4, out=codes[:, :, :, 1], casting="unsafe")      # sub-block 2·run + 1
    scale = d[..., None] * sc.astype(np.float32)                              # d·sc: exact in float32
    offset = -(dmin[..., None] * m.astype(np.float32))
    return codes.reshape(rows, n_blocks * 8, 32), scale.reshape(rows, -1), offset.reshape(rows, -1)


def decode_q6_k(raw: np.ndarray):
    """raw [rows, n_blocks, 210] -> codes - 32 [rows, n_blocks * 16, 16], scale [rows, n_blocks * 16], None.

    Each half block (128 weights) has 64 bytes of low bits and 32 of high bits. Weight 32k + j of a
    half (k = 0..3, j = 0..31) takes its low 4 bits from byte j (k = 0, 2) or 32 + j (k = 1, 3), the
    low nibble for k < 2, and its high 2 bits from bits 2k, 2k+1 of high byte j."""
    rows, n_blocks = raw.shape[:2]
    low = raw[..., 0:128].reshape(rows, n_blocks, 2, 1, 2, 32)               # [.., half, ., byte run, j]
    high = raw[..., 128:192].reshape(rows, n_blocks, 2, 1, 32)               # [.., half, ., j]
    low4 = np.concatenate([low & 15, low >> 4], axis=3)                       # [.., half, nibble, run, j]
    high2 = np.concatenate([(high >> shift) & 3 for shift in (0, 2, 4, 6)], axis=3)   # [.., half, k, j]
    q = low4.reshape(rows, n_blocks, 2, 4, 32) | (high2 << 4)                 # 0..63
    codes = np.subtract(q, np.float32(32), dtype=np.float32)                  # q - 32, widened in the same pass
    scale = _fp16(raw[..., 208:210])[..., None] * raw[..., 192:208].view(np.int8).astype(np.float32)
    return codes.reshape(rows, n_blocks * 16, 16), scale.reshape(rows, -1), None


DECODERS = {"Q8_0": decode_q8_0, "Q4_K": decode_q4_k, "Q6_K": decode_q6_k}


@dataclass
class GGMLWeight(QuantizedWeight):
    """A matrix W [out, in] in one of BLOCKS' formats, its rows' bytes as the GGUF stores them."""
    blocks: np.ndarray                  # uint8 [out, in / block * block_bytes] (a view of the file, or a copy)
    kind: str                           # "Q8_0" | "Q4_K" | "Q6_K"
    row_order: np.ndarray | None = None  # W's row r is stored row row_order[r] (llama.cpp's Q/K order); None: same

    @property
    def shape(self) -> tuple[int, int]:
        block, block_bytes = BLOCKS[self.kind]
        return self.blocks.shape[0], self.blocks.shape[1] // block_bytes * block

    def decode(self, stored_rows) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """codes [rows, sub-blocks, size], scale and offset [rows, sub-blocks] (offset None: 0) of stored rows."""
        raw = self.blocks[stored_rows]
        return DECODERS[self.kind](raw.reshape(raw.shape[0], -1, BLOCKS[self.kind][1]))

    def dequantize_rows(self, start: int, stop: int) -> np.ndarray:
        rows = slice(start, stop) if self.row_order is None else self.row_order[start:stop]
        return self._widen(rows)

    def _widen(self, stored_rows) -> np.ndarray:
        """Stored rows in fp32.   -> [rows, in]"""
        codes, scale, offset = self.decode(stored_rows)
        w = codes * scale[..., None]                                         # (d·sc)·q: llama.cpp's order
        if offset is not None:
            w += offset[..., None]
        return w.reshape(w.shape[0], -1)

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """x @ Wᵀ over the stored rows a tile at a time, then put in W's row order.   x: [T, in] -> [T, out]"""
        out_dim, in_dim = self.shape
        if x.shape[0] > DOT_ROWS:                                            # prefill: widen each tile once
            y = blockwise_matmul(x, out_dim, lambda start, stop: self._widen(slice(start, stop)), 4 * in_dim,
                                 BLOCK_BYTES)
        else:
            y = self._dot_matmul(x)
        return y if self.row_order is None else y[:, self.row_order]

    def _dot_matmul(self, x: np.ndarray) -> np.ndarray:
        """Σ_j w_j·x_j per sub-block = scale · (codes · x) + offset · Σ x: only the codes are widened.
        The hot spot of decode on a kept GGUF: every code of the model is cut out and widened here each token.
        (Tiles on two threads measured no faster on the 2 busy cores here: lessons/BENCHMARKS.md.)"""
        out_dim, in_dim = self.shape
        T, size = x.shape[0], SUB_BLOCK[self.kind]
        x_sub = np.ascontiguousarray(x.reshape(T, in_dim // size, size).transpose(1, 2, 0))   # [S, size, T]
        x_sums = x_sub.sum(axis=1)                                           # [S, T]
        rows = max(1, BLOCK_BYTES // (4 * in_dim))
        y = np.empty((T, out_dim), dtype=np.float32)
        for start in range(0, out_dim, rows):
            stop = min(start + rows, out_dim)
            codes, scale, offset = self.decode(slice(start, stop))            # [r, S, size], [r, S]
            dots = np.matmul(codes.transpose(1, 0, 2), x_sub)                 # [S, r, T]: Σ q·x per sub-block
            part = np.einsum("srt,rs->tr", dots, scale)                       # [T, r]
            if offset is not None:
                part += x_sums.T @ offset.T                                  # [T, S] @ [S, r]
            y[:, start:stop] = part
        return y

    def tensors(self, prefix: str) -> dict[str, np.ndarray]:
        return {prefix + ".blocks": self.blocks}
