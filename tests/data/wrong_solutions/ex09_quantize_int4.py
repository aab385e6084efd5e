"""A deliberately wrong solution of exercise 09: it packs element 2j into the high nibble instead of the low one.
The grader must fail it on the case named FAILS_CASE, with SAYS in its message (tests/test_exercises.py)."""
import numpy as np

FAILS_CASE = 'one row of 32'
SAYS = 'LOW 4 bits'


def quantize_int4_groupwise(w, group_size):
    out, n = w.shape
    g = np.pad(w, ((0, 0), (0, -n % group_size)), mode="edge").reshape(out, -1, group_size)
    lo, hi = g.min(axis=-1), g.max(axis=-1)
    scales, mins = ((hi - lo) / 15).astype(np.float16), lo.astype(np.float16)
    s = scales.astype(np.float32)[..., None]
    q = np.clip(np.rint((g - mins.astype(np.float32)[..., None]) / np.where(s > 0, s, 1.0)), 0, 15)
    q = np.where(s > 0, q, 0).astype(np.uint8).reshape(out, -1)
    return ((q[:, 0::2] << 4) | q[:, 1::2]).astype(np.uint8), scales, mins
