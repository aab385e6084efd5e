"""A deliberately wrong solution of exercise 02: it builds new arrays instead of writing into the cache.
The grader must fail it on the case named FAILS_CASE, with SAYS in its message (tests/test_exercises.py)."""
import numpy as np

FAILS_CASE = 'prefill'
SAYS = 'in place'


def kv_cache_update(cache_k, cache_v, k_new, v_new, pos):
    if pos + k_new.shape[1] > cache_k.shape[1]:
        raise ValueError("full")
    return (np.concatenate([cache_k[:, :pos], k_new], axis=1),
            np.concatenate([cache_v[:, :pos], v_new], axis=1))
