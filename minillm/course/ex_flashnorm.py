"""Exercise 15, FlashNorm: the RMSNorm gain folded into the next projection's weights."""
from __future__ import annotations

import numpy as np

from minillm.course.cases import Case, CaseFailed, case_rng, expect_close, expect_unchanged


def fold_rmsnorm_reference(gain: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The engine's `flashnorm.fold_rmsnorm_into_linear`."""
    from minillm.model.flashnorm import fold_rmsnorm_into_linear
    return fold_rmsnorm_into_linear(gain, w)


def _fold_cases() -> list[Case]:
    rng = case_rng(15)

    def case(name, out, n_in, spread=0.3):
        w = (rng.standard_normal((out, n_in)) * 0.05).astype(np.float32)
        gain = (1.0 + spread * rng.standard_normal(n_in)).astype(np.float32)
        return Case(name, dict(w=w, gain=gain))
    return [case("square [64, 64]: rows or columns?", 64, 64),
            case("SmolLM2's q_proj [576, 576]", 576, 576),
            case("gate_proj shape [1536, 576]: out != in", 1536, 576),
            case("k_proj shape [192, 576] with large gains (spread 2)", 192, 576, spread=2.0),
            case("one output row [1, 32]", 1, 32)]


def _check_fold(fn, case: Case) -> str:
    from minillm.model.layers import rmsnorm
    w, gain = case.inputs["w"], case.inputs["gain"]
    w_in, gain_in = w.copy(), gain.copy()
    got = fn(gain_in, w_in)
    expect_unchanged("w", w, w_in)
    expect_unchanged("gain", gain, gain_in)
    want = fold_rmsnorm_reference(gain, w)
    if isinstance(got, np.ndarray) and got.shape == want.shape and not np.allclose(got, want, rtol=1e-4, atol=1e-7):
        for wrong, hint in ((w * gain[:, None] if w.shape[0] == w.shape[1] else None,
                             "scaled the rows of W: the gain multiplies input channels, i.e. the columns of "
                             "W in [out, in] layout (W * gain[None, :])"),
                            (w / gain[None, :], "divided by the gain; folding multiplies W's columns by it"),
                            (w * gain[None, :] ** 2, "multiplied by gain twice")):
            if wrong is not None and np.allclose(got, wrong, rtol=1e-4, atol=1e-7):
                raise CaseFailed(hint)
    summary = expect_close("W*", got, want)
    x = case_rng(w.shape[0]).standard_normal((3, w.shape[1])).astype(np.float32) * 2
    expect_close("rmsnorm(x, ones) @ W*.T", rmsnorm(x, np.ones_like(gain), 1e-5) @ got.T, rmsnorm(x, gain, 1e-5) @ w.T)
    return summary + "; rmsnorm(x, gain) @ W.T == rmsnorm(x, ones) @ W*.T"
