"""Exercise 24 (lesson 24): FlashAttention's online softmax, merging two partial results.

Reference solution (for teachers; never in the handout). The stub is lessons/exercises/ex24_merge_softmax_partials.py.

Write `merge_softmax_partials` below, then check it:
    minillm exercise check 24         (in a clone: pytest lessons/exercises --exercise 24)
The grader compares it with `minillm.course.merge_partials_reference`, the combine step of
minillm/cuda/dev/kernels/attention_v1.cu (attention_combine) written in NumPy, and checks that acc / l is the
softmax attention over the keys of both parts.
"""
import numpy as np


def merge_softmax_partials(m_a: np.ndarray, l_a: np.ndarray, acc_a: np.ndarray,
                           m_b: np.ndarray, l_b: np.ndarray, acc_b: np.ndarray):
    """Merge the softmax attention state of two disjoint sets of keys, a and b, for the same queries.

    For each query row, a part that saw the scores s_j and values v_j of its keys holds
        m    [rows]      max_j s_j                      (-inf if the part saw no key at all)
        l    [rows]      sum_j exp(s_j - m)             (0 if it saw no key)
        acc  [rows, hd]  sum_j exp(s_j - m) * v_j       (0 if it saw no key; NOT divided by l)
    returns  (m, l, acc) of the keys of a and b together, in the same form, so that acc / l[:, None]
             is softmax(scores) @ values over all the keys.

    Rescale each part to the new max before adding (exp(s - m_a) = exp(s - m) * exp(m_a - m)), so
    nothing is ever exponentiated above 0: scores near 1000 must still work in float32. A part with
    m = -inf has weight 0; when both parts are empty the result is (-inf, 0, 0), with no NaN.
    Do not modify the inputs in place.
    """
    m = np.maximum(m_a, m_b)                                     # [rows] the new running max
    ref = np.where(m == -np.inf, 0.0, m)                         # both empty: any finite reference will do
    w_a = np.where(m_a == -np.inf, 0.0, np.exp(m_a - ref)).astype(np.float32)   # <= 1: rescale part a
    w_b = np.where(m_b == -np.inf, 0.0, np.exp(m_b - ref)).astype(np.float32)
    return m, l_a * w_a + l_b * w_b, acc_a * w_a[:, None] + acc_b * w_b[:, None]


if __name__ == "__main__":   # `python lessons/exercises/ex24_merge_softmax_partials.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise(24, __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
