"""A deliberately wrong solution of exercise 14: it reads element 8k + i from the high nibble first.
The grader must fail it on the case named FAILS_CASE, with SAYS in its message (tests/test_exercises.py)."""
import numpy as np

FAILS_CASE = 'which nibble is element 0'
SAYS = 'LOW nibble'


def dequantize_int4_words(words, scales, mins, in_features):
    out, n_words = words.shape
    shifts = (4 * (np.arange(8) ^ 1)).astype(np.uint32)
    codes = ((words.astype(np.uint32)[:, :, None] >> shifts) & np.uint32(0xF)).reshape(out, 8 * n_words)
    group = np.arange(8 * n_words) // (8 * n_words // scales.shape[1])
    deq = codes * scales.astype(np.float32)[:, group] + mins.astype(np.float32)[:, group]
    return deq[:, :in_features].astype(np.float32)
