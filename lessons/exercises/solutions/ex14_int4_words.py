"""Exercise 14 (lesson 14): read int4 weights the way the GPU kernel does, one 32-bit word at a time.

Reference solution (for teachers; never in the handout). The stub is lessons/exercises/ex14_int4_words.py.

Write `dequantize_int4_words` below, then check it:
    minillm exercise check 14         (in a clone: pytest lessons/exercises --exercise 14)
The grader compares it with the engine's `minillm.model.quant.Int4Weight.dequantize` on the same bytes.
"""
import numpy as np


def dequantize_int4_words(words: np.ndarray, scales: np.ndarray, mins: np.ndarray, in_features: int) -> np.ndarray:
    """W [out, in_features] in float32 from int4 codes packed as kernels/gemv_quant.cu loads them.

    minillm.model.quant packs two codes a byte: byte j of a row holds element 2j in its low nibble (bits 0-3)
    and element 2j + 1 in its high nibble (bits 4-7). The GPU loads 16 bytes at a time and works on them
    as four 32-bit words, little-endian: byte 0 is the word's lowest 8 bits. Here every row arrives as
    such words, so word k of a row holds elements 8k .. 8k + 7.

    1. Unpack with shifts and masks on the uint32 words (no .view(np.uint8)): which bits of word k hold
       element 8k + i?  -> codes 0..15, [out, 8 * words_per_row]
    2. Element e belongs to group e // g, where g = 8 * words_per_row / groups (scales.shape[1]):
       w = code * scale + min, in float32 (scales and mins are float16).
    3. Rows were padded to whole groups: keep only the first `in_features` columns.

    words        uint32 [out, in_padded / 8]; do not modify it (nor scales, mins)
    scales, mins float16 [out, in_padded / g]
    returns      float32 [out, in_features]
    """
    out, n_words = words.shape
    w = words.astype(np.uint32)
    shifts = (4 * np.arange(8)).astype(np.uint32)                # element 8k + i: bits 4i .. 4i + 3 of word k
    codes = ((w[:, :, None] >> shifts) & np.uint32(0xF)).reshape(out, 8 * n_words)
    g = 8 * n_words // scales.shape[1]
    group = np.arange(8 * n_words) // g
    deq = codes.astype(np.float32) * scales.astype(np.float32)[:, group] + mins.astype(np.float32)[:, group]
    return deq[:, :in_features]


if __name__ == "__main__":   # `python lessons/exercises/ex14_int4_words.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise(14, __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
