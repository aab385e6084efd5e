"""A deliberately wrong solution of exercise 03: it rotates neighbouring pairs (llama.cpp's layout) instead of the two halves.
The grader must fail it on the case named FAILS_CASE, with SAYS in its message (tests/test_exercises.py)."""
import numpy as np

FAILS_CASE = 'prefill'
SAYS = 'max abs error'


def apply_rope(x, cos, sin):
    c, s = cos[:, None, :], sin[:, None, :]
    out = np.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
    out[..., 1::2] = x[..., 1::2] * c + x[..., 0::2] * s
    return out
