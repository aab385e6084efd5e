"""A deliberately wrong solution of exercise 26: it writes the handed-over blocks at ids 0..n-1, as if
the decode worker's pool were empty, overwriting other sequences' blocks.
The grader must fail it on the case named FAILS_CASE, with SAYS in its message (tests/test_exercises.py)."""
import numpy as np

FAILS_CASE = "free blocks out of order"
SAYS = "from free_blocks"


def install_handoff(pool_k, pool_v, free_blocks, k_blocks, v_blocks):
    n = k_blocks.shape[1]
    table = np.arange(n)
    pool_k, pool_v = pool_k.copy(), pool_v.copy()
    pool_k[:, table] = k_blocks
    pool_v[:, table] = v_blocks
    return pool_k, pool_v, table
