"""A deliberately wrong solution of exercise 17: it numbers every chunk's positions from 0.
The grader must fail it on the case named FAILS_CASE, with SAYS in its message (tests/test_exercises.py)."""
import numpy as np

FAILS_CASE = 'a decode step of 3'
SAYS = "continue from the chunk's `start`"


def pack_batch(chunks):
    tokens = np.concatenate([np.asarray(t, dtype=np.int64) for t, _ in chunks])
    positions = np.concatenate([np.arange(len(t)) for t, _ in chunks])
    return tokens, positions, np.cumsum([len(t) for t, _ in chunks]) - 1
