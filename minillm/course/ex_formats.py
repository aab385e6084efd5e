"""Exercise 23 (lesson 23), MXFP4: encode one block of 32 weights as 32 FP4 E2M1 codes and one E8M0
power-of-two scale (the OCP microscaling format, formats.encode_mx_block)."""
from __future__ import annotations

import numpy as np

from minillm.course.cases import Case, CaseFailed, _expect_tuple, case_rng, expect_unchanged


def encode_mxfp4_block_reference(block: np.ndarray) -> tuple[np.ndarray, int]:
    """The engine's encoder.   block float32 [32] -> (codes uint8 [32], values 0..15; scale byte 0..254)"""
    from minillm.model.formats import encode_mx_block
    return encode_mx_block(block)


def _e2m1_values() -> np.ndarray:
    from minillm.model.formats import value_table
    return value_table("e2m1")


def _block_cases() -> list[Case]:
    rng = case_rng(23)

    def normal(s=1.0):
        return (rng.standard_normal(32) * s).astype(np.float32)
    outlier = normal(0.01)
    outlier[5] = 3.0
    clip = np.linspace(-1, 1, 32).astype(np.float32)
    clip[0] = 7.9                                                       # amax 7.9 -> scale 1, 7.9 clips to 6
    ties = np.zeros(32, np.float32)
    ties[:5] = [4.0, 0.25, 0.75, 2.5, 5.0]                              # exactly between two E2M1 values
    return [Case("32 normal weights, std 1", dict(block=normal())),
            Case("small weights (std 0.02): a negative exponent", dict(block=normal(0.02))),
            Case("one outlier among tiny weights", dict(block=outlier)),
            Case("amax 7.9: the top of [4, 8) x 2^e clips to 6 x 2^e", dict(block=clip)),
            Case("ties round to the even code (0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4)", dict(block=ties)),
            Case("all zeros: scale byte 0 (2^-127), codes 0", dict(block=np.zeros(32, np.float32)))]


def _check_block(fn, case: Case) -> str:
    block = case.inputs["block"]
    given = block.copy()
    got = fn(given)
    if not (isinstance(got, tuple) and len(got) == 2):
        raise CaseFailed(f"returned {type(got).__name__}, expected a tuple (codes, scale)")
    codes, scale = got
    _expect_tuple((codes,), 1, "codes")
    expect_unchanged("block", block, given)
    want_codes, want_scale = encode_mxfp4_block_reference(block)
    if codes.shape != (32,) or not np.issubdtype(codes.dtype, np.integer):
        raise CaseFailed(f"codes: expected 32 integer codes (uint8, 0..15), got {codes.dtype} {list(codes.shape)}")
    if int(scale) != want_scale:
        raise CaseFailed(f"scale byte {int(scale)} (2^{int(scale) - 127}), expected {want_scale} "
                         f"(2^{want_scale - 127} = 2^(floor(log2(amax)) - 2))")
    values = _e2m1_values()
    wrong = np.flatnonzero(codes.astype(np.int64) != want_codes)
    if wrong.size:
        j = int(wrong[0])
        raise CaseFailed(f"element {j} = {block[j]:.6g}: code {int(codes[j])} ({values[int(codes[j]) % 16]:g} x scale), "
                         f"expected {int(want_codes[j])} ({values[want_codes[j]]:g} x scale); "
                         f"{wrong.size} of 32 codes differ")
    err = np.abs(values[codes.astype(np.int64)] * 2.0 ** (want_scale - 127) - block).max()
    return f"codes and scale 2^{want_scale - 127} exact, max |decoded - block| {err:.3g}"
