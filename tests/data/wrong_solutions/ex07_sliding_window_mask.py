"""A deliberately wrong solution of exercise 07: it lets each query see window + 1 keys.
The grader must fail it on the case named FAILS_CASE, with SAYS in its message (tests/test_exercises.py)."""
import numpy as np

FAILS_CASE = 'prefill'
SAYS = 'one too many'


def sliding_window_mask(n_queries, n_keys, window):
    q = np.arange(n_keys - n_queries, n_keys)[:, None]
    k = np.arange(n_keys)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= k >= q - window
    return allowed
