"""A deliberately wrong solution of exercise 10: it uses one scale per head for all its positions.
The grader must fail it on the case named FAILS_CASE, with SAYS in its message (tests/test_exercises.py)."""
import numpy as np

FAILS_CASE = '20x larger'
SAYS = 'one scale per head'


def quantize_kv_int8(x):
    scales = np.broadcast_to(np.abs(x).max(axis=(1, 2))[:, None] / 127, x.shape[:2]).astype(np.float32)
    return np.clip(np.rint(x / np.where(scales > 0, scales, 1)[..., None]), -127, 127).astype(np.int8), scales
