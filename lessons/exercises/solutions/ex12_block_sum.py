"""Exercise 12 (lesson 12): the exact order in which one CUDA block adds up a row.

Reference solution (for teachers; never in the handout). The stub is lessons/exercises/ex12_block_sum.py.

Write `block_sum` below, then check it:
    minillm exercise check 12         (in a clone: pytest lessons/exercises --exercise 12)
The grader compares it bit for bit with an emulation of kernels/common.cuh's block_sum, which lesson 12
checks against the GPU itself.
"""
import numpy as np


def block_sum(values: np.ndarray, n_threads: int) -> np.ndarray:
    """Sum each row of `values` in float32, adding in exactly the order a block of the RMSNorm kernel does.

    values     float32 [rows, n]; one block of n_threads threads sums each row (do not modify values)
    n_threads  threads in the block: a multiple of 32 (a warp), at most 1024
    returns    float32 [rows]

    The three steps of kernels/rmsnorm.cu + block_sum in kernels/common.cuh, every addition in fp32:
    1. Thread t (0 <= t < n_threads) starts from 0.0 and adds values[:, t], values[:, t + n_threads],
       values[:, t + 2·n_threads], ... in that order (a thread with no values keeps 0.0).
    2. Warp w is threads 32w .. 32w + 31; thread 32w + l is its lane l. Five rounds, o = 16, 8, 4, 2, 1:
       every lane l at once does v = v + (the v of lane l ^ o)   (__shfl_xor_sync). Afterwards every
       lane of the warp holds the warp's total.
    3. Warp 0 takes the n_threads / 32 warp totals into its lanes 0, 1, ... (the other lanes hold 0.0)
       and runs the same five rounds. Its lane 0 holds the row's sum.
    Floating-point addition is not associative: another order gives the right sum to fp32 precision but
    (often) different last bits. The GPU gives these bits every time; so must you.
    """
    v = np.asarray(values, dtype=np.float32)
    rows, n = v.shape
    acc = np.zeros((rows, n_threads), np.float32)                # 1. one register per thread
    for start in range(0, n, n_threads):
        chunk = v[:, start:start + n_threads]
        acc[:, :chunk.shape[1]] = acc[:, :chunk.shape[1]] + chunk
    lane = np.arange(32)

    def warp_sum(lanes):                                         # [..., 32] -> every lane holds the total
        for o in (16, 8, 4, 2, 1):
            lanes = lanes + lanes[..., lane ^ o]
        return lanes
    totals = warp_sum(acc.reshape(rows, n_threads // 32, 32))[..., 0]   # 2. [rows, n_warps]
    lanes = np.zeros((rows, 32), np.float32)                     # 3. warp 0 reduces the warp totals
    lanes[:, :totals.shape[1]] = totals
    return warp_sum(lanes)[:, 0]


if __name__ == "__main__":   # `python lessons/exercises/ex12_block_sum.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise(12, __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
