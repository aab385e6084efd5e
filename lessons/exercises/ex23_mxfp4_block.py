"""Exercise 23 (lesson 23): encode one MXFP4 block, 32 weights as FP4 E2M1 codes and one E8M0 scale.

Write `encode_mxfp4_block` below, then check it:
    minillm exercise check 23         (in a clone: pytest lessons/exercises --exercise 23)
The grader compares it with the engine's `minillm.model.formats.encode_mx_block`, which
`quantize_mxfp4` applies to every block of 32 weights of a row.
"""
import numpy as np


def encode_mxfp4_block(block: np.ndarray) -> tuple[np.ndarray, int]:
    """OCP microscaling FP4: one power-of-two scale for the block, one 4-bit float per element.

    1. The shared exponent: e = floor(log2(max |block|)) - 2 (2 is the exponent of E2M1's largest
       value, 6 = 1.5 · 2²), so the largest element lands in [4, 8) · 2^e. An all-zero block takes
       e = -127. Clip e to [-127, 127]. The scale byte (E8M0) is e + 127.
    2. Divide the block by 2^e and clip to [-6, 6]: E2M1 has no larger value, so [6, 8) · 2^e is cut.
    3. Round each to the nearest E2M1 value, ties to the even code. E2M1 is 1 sign, 2 exponent and 1
       mantissa bit; codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8..15 the same, negative.
       (ml_dtypes.float4_e2m1fn does this rounding: x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8).)

    block    float32 [32]; do not modify it
    returns  (codes uint8 [32], values 0..15; the scale byte, an int 0..254)
    """
    raise NotImplementedError("write encode_mxfp4_block: see the docstring")


if __name__ == "__main__":   # `python lessons/exercises/ex23_mxfp4_block.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise(23, __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
