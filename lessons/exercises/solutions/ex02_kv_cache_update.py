"""Exercise 02 (lesson 02): writing new keys and values into a preallocated KV cache.

Reference solution (for teachers; never in the handout). The stub is lessons/exercises/ex02_kv_cache_update.py.

Write `kv_cache_update` below, then check it:
    minillm exercise check 2          (in a clone: pytest lessons/exercises --exercise 2)
The grader compares it with the engine's `minillm.model.kv_cache.KVCache.append` on random inputs.
"""
import numpy as np


def kv_cache_update(cache_k: np.ndarray, cache_v: np.ndarray, k_new: np.ndarray, v_new: np.ndarray,
                    pos: int) -> tuple[np.ndarray, np.ndarray]:
    """Store T new positions of one layer in its cache; return the keys and values seen so far.

    cache_k, cache_v: [n_kv_heads, max_seq, head_dim]  preallocated; slots pos.. are free
                      (they may hold stale numbers from an earlier sequence: overwrite them)
    k_new, v_new:     [n_kv_heads, T, head_dim]        the new positions' keys and values
    pos:              how many positions the cache already holds
    returns (keys, values), each [n_kv_heads, pos + T, head_dim]

    The contract:
    - write in place: after the call cache_k[:, pos:pos+T] == k_new (same for v); nothing else changes
    - return views of the cache (slices), not copies: copying would cost O(length) per token
    - raise ValueError if pos + T > max_seq (the cache is full)
    """
    T = k_new.shape[1]
    if pos + T > cache_k.shape[1]:
        raise ValueError(f"cache full: {pos} + {T} positions > capacity {cache_k.shape[1]}")
    cache_k[:, pos:pos + T] = k_new                              # in place: the slots after the old ones
    cache_v[:, pos:pos + T] = v_new
    return cache_k[:, :pos + T], cache_v[:, :pos + T]            # views, no copy


if __name__ == "__main__":   # `python lessons/exercises/ex02_kv_cache_update.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise(2, __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
