"""Exercise 15 (lesson 15): fold an RMSNorm gain into the linear layer that follows it (FlashNorm, Prop. 1).

Reference solution (for teachers; never in the handout). The stub is lessons/exercises/ex15_fold_rmsnorm.py.

Write `fold_rmsnorm_into_linear` below, then check it:
    minillm exercise check 15          (in a clone: pytest lessons/exercises --exercise 15)
The grader compares it with the engine's `minillm.model.flashnorm.fold_rmsnorm_into_linear`.
"""
import numpy as np


def fold_rmsnorm_into_linear(gain: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Return W* so that the gain can be dropped from the norm:

        rmsnorm(x, gain) @ W.T  ==  rmsnorm(x, ones) @ W*.T      for every x

    rmsnorm(x, gain) = x / RMS(x) * gain multiplies input channel j by gain[j]; W is in HF's
    [out, in] layout (y = x @ W.T), so channel j meets column j of W.

    gain     float32 [in]
    w        float32 [out, in]; do not modify it (nor gain)
    returns  float32 [out, in]
    """
    return w * gain[None, :]                                     # column j of W meets channel j


if __name__ == "__main__":   # `python lessons/exercises/ex15_fold_rmsnorm.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise(15, __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
