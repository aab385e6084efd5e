"""Exercise 27 (lesson 27): constrained decoding, the token mask of one grammar state.

Write `dfa_token_mask` below, then check it:
    minillm exercise check 27         (in a clone: pytest lessons/exercises --exercise 27)
The grader compares it with `minillm.course.dfa_token_mask_reference` (lesson 27's hand-built mask) on the
regex `[0-9]+ (kg|g)` and on random DFAs with thousands of tokens.
"""
import numpy as np


def dfa_token_mask(transitions: np.ndarray, state: int, token_bytes: np.ndarray,
                   token_lengths: np.ndarray) -> np.ndarray:
    """Which tokens may come next when a grammar's DFA is in `state`.

    transitions    int [n_states, 256]: the state reached from each state on each byte, -1 where the grammar
                   has no transition (reading that byte there breaks the grammar)
    token_bytes    uint8 [vocab, max_len]: each token's bytes, left-aligned; what follows its length is padding
                   (any value: do not read it)
    token_lengths  int [vocab]: each token's number of bytes; 0 for tokens with no bytes (control tokens)
    returns        bool [vocab]: True where reading all of the token's bytes from `state` never meets -1.
                   A token with no bytes is never allowed (it would move the grammar nowhere).

    Walk every token at once (one byte position per step, the tokens still reading at that position), rather
    than a Python loop over 49,152 tokens: the engine fills such a mask every step. Do not modify the inputs.
    """
    raise NotImplementedError("write dfa_token_mask: see the docstring")


if __name__ == "__main__":   # `python lessons/exercises/ex27_dfa_token_mask.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise(27, __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
