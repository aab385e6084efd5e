"""Exercise 01 (lesson 01): RMSNorm, the normalization in front of every attention and MLP block.

Write `rmsnorm` below, then check it:
    minillm exercise check 1          (in a clone: pytest lessons/exercises --exercise 1)
The grader compares it with the engine's own `minillm.model.layers.rmsnorm` on random inputs.
"""
import numpy as np


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Scale each row of x to unit root-mean-square, then multiply by the learned gain.

    x:      [T, dim]  float32, one row per position
    weight: [dim]     the gain g, one number per channel
    eps:    a small constant (1e-5 in SmolLM2) added to the mean square, inside the square root,
            so a row of near-zeros does not blow up
    returns [T, dim]: x / sqrt(mean(x², over dim) + eps) * weight

    Unlike LayerNorm there is no mean subtraction and no bias. Do not modify x in place.
    """
    raise NotImplementedError("write rmsnorm: see the docstring")


if __name__ == "__main__":   # `python lessons/exercises/ex01_rmsnorm.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise(1, __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
