"""Exercise 08 (lesson 08): symmetric int8 quantization of a weight matrix, one scale per output row.

Write `quantize_int8_per_row` below, then check it:
    minillm exercise check 8          (in a clone: pytest lessons/exercises --exercise 8)
The grader compares it with the engine's `minillm.model.quant.quantize_int8`.
"""
import numpy as np


def quantize_int8_per_row(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantize W [out, in] to int8 codes with one fp32 scale per row (output channel).

    scale[r] = max_j |W[r, j]| / 127           (a row of zeros has scale 0 and codes 0: no NaN)
    q[r, j]  = round(W[r, j] / scale[r]), clipped to -127 .. 127, stored as np.int8
    so that W ≈ q · scale[:, None], with every error at most scale / 2.

    w        float32 [out, in]; do not modify it
    returns  (q int8 [out, in], scales float32 [out])
    """
    raise NotImplementedError("write quantize_int8_per_row: see the docstring")


if __name__ == "__main__":   # `python lessons/exercises/ex08_quantize_int8.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise(8, __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
