"""Exercise 07 (lesson 07): which keys each query may attend to, causal and with a sliding window.

Write `sliding_window_mask` below, then check it:
    minillm exercise check 7          (in a clone: pytest lessons/exercises --exercise 7)
The grader compares it with the engine's `minillm.model.attention.attention_mask`.
"""
import numpy as np


def sliding_window_mask(n_queries: int, n_keys: int, window: int | None) -> np.ndarray:
    """The attention mask of a chunk of queries against every key position.

    n_queries: T, the new positions: they are the LAST T of the n_keys positions (at decode T = 1
               and it is the newest position; at prefill of an empty cache T = n_keys)
    n_keys:    L, every position so far (cached + new)
    window:    W, Mistral's sliding window: a query at position p sees keys p - W + 1 .. p (W keys,
               itself included); None means plain causal attention (keys 0 .. p)
    returns    bool [T, L]: True where query i may attend to key j
    """
    raise NotImplementedError("write sliding_window_mask: see the docstring")


if __name__ == "__main__":   # `python lessons/exercises/ex07_sliding_window_mask.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise(7, __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
