"""A deliberately wrong solution of exercise 23: its shared exponent is floor(log2(amax)), without
the - 2 of E2M1's largest exponent, so every block is scaled 4x too coarse. The grader must fail it
on the case named FAILS_CASE, with SAYS in its message (tests/test_exercises.py)."""
import numpy as np

FAILS_CASE = "32 normal weights"
SAYS = "scale byte"


def encode_mxfp4_block(block):
    import ml_dtypes
    amax = float(np.abs(block).max())
    e = int(np.floor(np.log2(amax))) if amax > 0 else -127
    scaled = np.clip(block / np.float32(2.0 ** e), -6.0, 6.0)
    return scaled.astype(ml_dtypes.float4_e2m1fn).view(np.uint8), e + 127
