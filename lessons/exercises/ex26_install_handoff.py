"""Exercise 26 (lesson 26): disaggregated serving, the decode worker installs the handed-over KV blocks.

Write `install_handoff` below, then check it:
    minillm exercise check 26         (in a clone: pytest lessons/exercises --exercise 26)
The grader checks the blocks land in free blocks of the pool, in sequence order through the returned
block table, and that no other sequence's block changes (what minillm/engine/disaggregated.py's
`install_blocks` does for every layer).
"""
import numpy as np


def install_handoff(pool_k: np.ndarray, pool_v: np.ndarray, free_blocks: np.ndarray, k_blocks: np.ndarray,
                    v_blocks: np.ndarray):
    """Place a prompt's KV blocks, handed over by a prefill worker, in this decode worker's paged pool.

    pool_k, pool_v      [layers, n_blocks, block_size, n_kv_heads, head_dim]  this worker's pool; blocks not
                        in free_blocks hold other sequences' keys and values
    free_blocks         [n_free] ids of blocks nobody uses (in no particular order)
    k_blocks, v_blocks  [layers, n, block_size, n_kv_heads, head_dim]  the prompt's blocks in sequence
                        order: block j holds positions j * block_size .. (j + 1) * block_size - 1
    returns             (pool_k, pool_v, block_table): new pools with the handed-over blocks written into
                        n different free blocks, and block_table [n] (integers) naming the block that
                        holds sequence block j at entry j, so the pool read through it is the prompt's cache.
    Do not modify the inputs in place.
    """
    raise NotImplementedError("write install_handoff: see the docstring")


if __name__ == "__main__":   # `python lessons/exercises/ex26_install_handoff.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise(26, __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
