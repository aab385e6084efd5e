"""Exercise 16 (lesson 16): read one sequence's keys back from the paged pool, through its block table.

Reference solution (for teachers; never in the handout). The stub is lessons/exercises/ex16_block_table_gather.py.

Write `gather_through_block_table` below, then check it:
    minillm exercise check 16          (in a clone: pytest lessons/exercises --exercise 16)
The grader compares it with the engine's `minillm.engine.paged_kv.PagedKVCache.read`.
"""
import numpy as np


def gather_through_block_table(pool: np.ndarray, block_table: list[int], length: int) -> np.ndarray:
    """The first `length` positions of one sequence, in position order, as attention wants them.

    The pool holds every sequence's keys (or values) of one layer in blocks of block_size positions;
    position p of this sequence lives in block block_table[p // block_size], slot p % block_size.
    The table may list blocks in any order, and may hold more blocks than `length` needs; the last
    block used may be only partly filled (ignore the slots past `length`).

    pool         float32 [n_blocks, block_size, n_kv_heads, head_dim]; do not modify it
    block_table  list of block ids
    returns      float32 [n_kv_heads, length, head_dim]
    """
    bs = pool.shape[1]
    n_blocks = -(-length // bs)
    blocks = pool[np.asarray(block_table[:n_blocks], dtype=np.int64)]   # [n, bs, n_kv, hd]
    seq = blocks.reshape(-1, *pool.shape[2:])[:length]           # [length, n_kv, hd]
    return np.ascontiguousarray(seq.transpose(1, 0, 2))          # [n_kv, length, hd]


if __name__ == "__main__":   # `python lessons/exercises/ex16_block_table_gather.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise(16, __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
