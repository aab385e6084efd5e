"""Exercise 09 (lesson 09): asymmetric int4 quantization in groups, packed two codes a byte.

Write `quantize_int4_groupwise` below, then check it:
    minillm exercise check 9          (in a clone: pytest lessons/exercises --exercise 9)
The grader compares it with the engine's `minillm.model.quant.quantize_int4(w, group_size)` (its .qweight,
.scales, .mins), i.e. the min/max grid. The engine then goes one step further and searches each
group's grid (`search=True`: clipping, weighted by how large each input column's activations are);
lesson 09's second half measures what that buys. The bytes' layout is the same either way.
"""
import numpy as np


def quantize_int4_groupwise(w: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantize W [out, in] to 4-bit codes, each group of `group_size` consecutive weights of a row
    with its own scale and min (an asymmetric grid of 16 levels from the group's min to its max).

    1. Pad each row to a whole number of groups by repeating its last weight (np.pad, mode="edge"):
       in_padded = ceil(in / group_size) · group_size.
    2. Per group: min, max;  scale = (max - min) / 15;  store scale and min as np.float16.
       (A constant group has scale 0: its codes are 0, not NaN.)
    3. Codes: q = round((w - min) / scale), clipped to 0 .. 15, with the fp16 scale and min.
    4. Pack two codes a byte: byte j of a row = q[2j] (low 4 bits) | q[2j + 1] << 4 (high 4 bits).

    w        float32 [out, in]; do not modify it
    returns  (packed uint8 [out, in_padded / 2], scales float16 [out, groups], mins float16 [out, groups])
    """
    raise NotImplementedError("write quantize_int4_groupwise: see the docstring")


if __name__ == "__main__":   # `python lessons/exercises/ex09_quantize_int4.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise(9, __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
