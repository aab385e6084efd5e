"""Exercise 21 (lesson 21): tensor parallelism, one rank's share of a transformer block.

Write `tp_partials` below, then check it:
    minillm exercise check 21         (in a clone: pytest lessons/exercises --exercise 21)
The grader runs it for every rank r of N and compares each rank's partials with
`minillm.course.tp_partials_reference` (the engine's split, engine/parallel/sharding.py), then checks
that the N partials sum to the unsharded block: what the all-reduce after o and after down computes.
"""
import numpy as np


def tp_partials(h: np.ndarray, weights: dict, n_heads: int, n_kv_heads: int, rank: int, n_ranks: int):
    """Rank `rank` of `n_ranks`: slice the block's weights Megatron-style and compute its partial outputs.

    h        [T, dim]  the block's normalized input (the same on every rank)
    weights  HF layout [out, in]: wq [n_heads*hd, dim], wk and wv [n_kv_heads*hd, dim], wo [dim, n_heads*hd],
             w_gate and w_up [ffn, dim], w_down [dim, ffn]          (hd = len(wq) // n_heads)
    returns  (attention partial [T, dim], MLP partial [T, dim])

    Attention: this rank's query heads are the r-th block of n_heads / N heads (q's rows for them); its
    KV heads are the r-th block of n_kv_heads / N, or, when there are fewer KV heads than ranks, the one
    KV head its query heads share (replicated). Run causal softmax attention (no RoPE: scores q·kᵀ/√hd,
    query head j of the rank reads the KV head of its group) and multiply by the matching COLUMNS of wo.
    MLP: the r-th block of ffn / N rows of w_gate and w_up, silu(gate) * up, then the matching columns of
    w_down. Each result is a partial sum: adding every rank's gives the unsharded block's output.
    Do not modify the inputs.
    """
    raise NotImplementedError("write tp_partials: see the docstring")


if __name__ == "__main__":   # `python lessons/exercises/ex21_shard_block.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise(21, __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
