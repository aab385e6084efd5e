"""A deliberately wrong solution of exercise 08: it takes the scale from max(w) instead of max(|w|).
The grader must fail it on the case named FAILS_CASE, with SAYS in its message (tests/test_exercises.py)."""
import numpy as np

FAILS_CASE = 'largest |w| is negative'
SAYS = 'max(|w|)'


def quantize_int8_per_row(w):
    scales = (w.max(axis=1) / 127).astype(np.float32)
    return np.clip(np.rint(w / np.where(scales > 0, scales, 1.0)[:, None]), -127, 127).astype(np.int8), scales
