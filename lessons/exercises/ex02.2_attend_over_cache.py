"""Exercise 02.2 (lesson 02): attention of the new positions over everything in the KV cache.

With exercise 02's cache write this is one layer's attention at decode (T = 1) and at prefill (T = the
prompt): the student-mode run (`minillm generate --student DIR`) puts yours in every layer of SmolLM2.

Write `attend_over_cache` below, then check it:
    minillm exercise check 2.2        (in a clone: pytest lessons/exercises --exercise 2.2)
The grader compares it with the engine's `minillm.model.attention.attend`.
"""
import numpy as np


def attend_over_cache(q: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """softmax(q·kᵀ / sqrt(head_dim), causal) · v for T new queries over the L positions in the cache.

    q:       [T, n_heads, head_dim]       the new positions' queries: they are the LAST T of the L
    keys:    [n_kv_heads, L, head_dim]    every position's keys so far (cached + new)
    values:  [n_kv_heads, L, head_dim]
    returns  [T, n_heads * head_dim]      each query's output, its heads side by side

    Query t sits at position L - T + t and may see keys 0 .. L - T + t (itself included). Query heads
    share KV heads in groups: head h uses KV head h // (n_heads // n_kv_heads). Scores can be large:
    subtract each row's max before exp. Do not modify the inputs in place.
    """
    raise NotImplementedError("write attend_over_cache: see the docstring")


if __name__ == "__main__":   # `python lessons/exercises/ex02.2_attend_over_cache.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise("2.2", __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
