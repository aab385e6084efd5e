"""A deliberately wrong solution of exercise 21: with fewer KV heads than ranks it gives rank r the KV
head r % n_kv_heads instead of the one its query heads read. The grader must fail it on the case named
FAILS_CASE, with SAYS in its message (tests/test_exercises.py)."""
import numpy as np

FAILS_CASE = "each KV head replicated on 2 ranks"
SAYS = "rank 1's attention partial: max abs error"


def tp_partials(h, weights, n_heads, n_kv_heads, rank, n_ranks):
    T, dim = h.shape
    hd = len(weights["wq"]) // n_heads
    per_rank = n_heads // n_ranks
    heads = range(rank * per_rank, (rank + 1) * per_rank)
    if n_kv_heads >= n_ranks:
        kv = range(rank * n_kv_heads // n_ranks, (rank + 1) * n_kv_heads // n_ranks)
    else:                                       # WRONG: deals KV heads round-robin, not by query group
        head = rank % n_kv_heads
        kv = range(head, head + 1)
    q_rows = slice(heads.start * hd, heads.stop * hd)
    kv_rows = slice(kv.start * hd, kv.stop * hd)
    q = (h @ weights["wq"][q_rows].T).reshape(T, len(heads), hd)           # [T, heads_r, hd]
    k = (h @ weights["wk"][kv_rows].T).reshape(T, len(kv), hd)             # [T, kv_r, hd]
    v = (h @ weights["wv"][kv_rows].T).reshape(T, len(kv), hd)
    group = len(heads) // len(kv)
    out = np.empty((T, len(heads), hd), dtype=np.float32)
    causal = np.tril(np.ones((T, T), dtype=bool))
    for j in range(len(heads)):
        s = q[:, j] @ k[:, j // group].T / np.sqrt(hd)                       # [T, T]
        s = np.where(causal, s, -np.inf)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, j] = (p / p.sum(axis=1, keepdims=True)) @ v[:, j // group]
    attn = out.reshape(T, -1) @ weights["wo"][:, q_rows].T                   # [T, dim] partial
    f = len(weights["w_gate"]) // n_ranks
    cols = slice(rank * f, (rank + 1) * f)
    gate, up = h @ weights["w_gate"][cols].T, h @ weights["w_up"][cols].T    # [T, f]
    mlp = (gate / (1 + np.exp(-gate)) * up) @ weights["w_down"][:, cols].T   # [T, dim] partial
    return attn.astype(np.float32), mlp.astype(np.float32)
