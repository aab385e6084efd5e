"""Exercise 05 (lesson 05): pool a checkpoint's K (or V) projection from n_kv_heads heads down to n_new.

Write `mean_pool_kv_heads` below, then check it:
    minillm exercise check 5          (in a clone: pytest lessons/exercises --exercise 5)
The grader compares it with the engine's `minillm.checkpoints.kv_heads.pool_heads` on random weights.
"""
import numpy as np


def mean_pool_kv_heads(w: np.ndarray, n_kv_heads: int, n_new: int, head_dim: int) -> np.ndarray:
    """Replace each group of n_kv_heads // n_new consecutive KV heads by their mean (the GQA paper's
    conversion, MHA -> GQA -> MQA).

    w:         [n_kv_heads * head_dim, dim]  float32, HF layout: head g is rows g*head_dim .. (g+1)*head_dim - 1
    n_kv_heads: the heads w holds now
    n_new:     the heads to keep; it divides n_kv_heads
    head_dim:  rows per head
    returns    [n_new * head_dim, dim] float32: new head j is the mean of old heads
               j*k .. j*k + k-1, with k = n_kv_heads // n_new

    Consecutive heads, not every n_new-th one: query head h read old KV head h // (n_heads // n_kv_heads)
    and will read new head h // (n_heads // n_new), which is the group its old head falls in.
    Average row by row within a head (row r of the new head is the mean of row r of each old head);
    do not modify w in place.
    """
    raise NotImplementedError("write mean_pool_kv_heads: see the docstring")


if __name__ == "__main__":   # `python lessons/exercises/ex05_mean_pool_kv_heads.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise(5, __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
