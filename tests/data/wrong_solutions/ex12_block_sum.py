"""A deliberately wrong solution of exercise 12: it sums in NumPy's own order.
The grader must fail it on the case named FAILS_CASE, with SAYS in its message (tests/test_exercises.py)."""
import numpy as np

FAILS_CASE = "Mistral's dim"
SAYS = "NumPy's own order"


def block_sum(values, n_threads):
    return values.sum(axis=1, dtype=np.float32)
