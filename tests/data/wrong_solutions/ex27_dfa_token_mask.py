"""A deliberately wrong solution of exercise 27: it reads every byte of the padded row, padding included.
The grader must fail it on the case named FAILS_CASE, with SAYS in its message (tests/test_exercises.py)."""
import numpy as np

FAILS_CASE = 'padding is not zeros'
SAYS = 'refused a token the DFA can read'


def dfa_token_mask(transitions, state, token_bytes, token_lengths):
    sink = transitions.shape[0]
    table = np.vstack([np.where(transitions < 0, sink, transitions), np.full((1, 256), sink)])
    at = np.full(len(token_lengths), state, dtype=np.int64)
    for j in range(token_bytes.shape[1]):
        at = table[at, token_bytes[:, j]]
    return (at != sink) & (token_lengths > 0)
