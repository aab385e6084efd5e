"""A deliberately wrong solution of exercise 02.2: no causal mask (every query sees every key).
The grader must fail it on the case named FAILS_CASE, with SAYS in its message (tests/test_exercises.py)."""
import numpy as np

FAILS_CASE = "a chunk of 3 new queries over 5 cached keys"
SAYS = "mask the keys after each query's own position"


def attend_over_cache(q, keys, values):
    T, n_heads, hd = q.shape
    group = n_heads // keys.shape[0]
    out = np.empty((T, n_heads, hd), dtype=np.float32)
    for h in range(n_heads):
        scores = q[:, h] @ keys[h // group].T / np.sqrt(hd)
        w = np.exp(scores - scores.max(axis=-1, keepdims=True))
        out[:, h] = (w / w.sum(axis=-1, keepdims=True)) @ values[h // group]
    return out.reshape(T, n_heads * hd)
