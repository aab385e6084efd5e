"""A deliberately wrong solution of exercise 20: on rejection it draws from p again instead of the
residual max(0, p - q), so tokens the draft likes come out too often.
The grader must fail it on the case named FAILS_CASE, with SAYS in its message (tests/test_exercises.py)."""
import numpy as np

FAILS_CASE = 'random p and q'
SAYS = 'residual'


def speculative_step(p, q, token):
    return min(1.0, float(p[token]) / float(q[token])), p / p.sum()
