"""Exercise 10 (lesson 10): int8 keys and values for the KV cache, one scale per (head, position).

Write `quantize_kv_int8` below, then check it:
    minillm exercise check 10         (in a clone: pytest lessons/exercises --exercise 10)
The grader compares it with what the engine's `minillm.model.kv_cache.Int8KVCache.append` stores.
"""
import numpy as np


def quantize_kv_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantize new keys (or values) of one layer to int8, each vector of head_dim values on its own.

    scale[h, t] = max_i |x[h, t, i]| / 127     (an all-zero vector has scale 0 and codes 0: no NaN)
    q[h, t, i]  = round(x[h, t, i] / scale[h, t]), clipped to -127 .. 127, stored as np.int8
    so that x ≈ q · scale[..., None]. A scale per token and head follows the tokens whose keys are
    large without coarsening the others.

    x        float32 [n_kv_heads, T, head_dim]; do not modify it
    returns  (q int8 [n_kv_heads, T, head_dim], scales float32 [n_kv_heads, T])
    """
    raise NotImplementedError("write quantize_kv_int8: see the docstring")


if __name__ == "__main__":   # `python lessons/exercises/ex10_quantize_kv_int8.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise(10, __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
