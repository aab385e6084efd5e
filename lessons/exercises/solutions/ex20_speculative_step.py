"""Exercise 20 (lesson 20): the step of speculative sampling that keeps the target's distribution exact.

Reference solution (for teachers; never in the handout). The stub is lessons/exercises/ex20_speculative_step.py.

Write `speculative_step` below, then check it:
    minillm exercise check 20         (in a clone: pytest lessons/exercises --exercise 20)
The grader compares it with the engine's rule (`minillm.engine.speculative.acceptance`), and then
enumerates every draft token to check that the token a step emits is distributed exactly as p.
"""
import numpy as np


def speculative_step(p: np.ndarray, q: np.ndarray, token: int) -> tuple[float, np.ndarray]:
    """(min(1, p[token] / q[token]), norm(max(0, p - q))): see the stub's docstring."""
    a = min(1.0, float(p[token]) / float(q[token]))
    r = np.maximum(p - q, 0.0)
    total = r.sum()
    return a, (r / total if total > 0 else p.copy())
