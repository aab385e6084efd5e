"""A deliberately wrong solution of exercise 01: it leaves eps out of the square root.
The grader must fail it on the case named FAILS_CASE, with SAYS in its message (tests/test_exercises.py)."""
import numpy as np

FAILS_CASE = 'tiny activations'
SAYS = 'max abs error'


def rmsnorm(x, weight, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True)) * weight
