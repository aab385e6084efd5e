"""Exercise 03 (lesson 03): rotary position embedding, applied to queries and keys at every position.

Prefill applies it to T positions at once, decode to one position at a time: the same function, and
the angle depends on the absolute position (the cache length at decode), not on the row index.

Write `apply_rope` below, then check it:
    minillm exercise check 3          (in a clone: pytest lessons/exercises --exercise 3)
The grader compares it with the engine's `minillm.model.layers.apply_rope` on random inputs.
"""
import numpy as np


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate pairs of dimensions of every head by their position's angles (HF's half-split layout).

    x:        [T, n_heads, head_dim]   queries or keys, T positions
    cos, sin: [T, head_dim // 2]       cos and sin of each position's angle for each pair
                                       (minillm.model.layers.rope_tables makes them)
    returns   [T, n_heads, head_dim]

    Pair i is (x[..., i], x[..., i + head_dim // 2]) — the first half against the second half,
    not neighbours. With x1, x2 the two halves, the result is the two halves
        x1·cos − x2·sin   and   x2·cos + x1·sin
    concatenated. Every head of a position uses the same angles. Do not modify x in place.
    """
    raise NotImplementedError("write apply_rope: see the docstring")


if __name__ == "__main__":   # `python lessons/exercises/ex03_apply_rope.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise(3, __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
