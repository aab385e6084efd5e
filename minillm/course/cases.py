"""What an exercise is made of: its cases, and the checks that compare a student's answer with the
engine's and raise CaseFailed with a description a student can act on."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class Case:
    name: str
    inputs: dict


@dataclass(frozen=True)
class Exercise:
    number: int
    function: str                          # the function the student writes
    lesson: int
    reference: Callable                    # the engine's solution, same signature as the student's
    cases: Callable[[], list[Case]]
    check: Callable[[Callable, Case], str]  # run one case; raise CaseFailed or return a summary


class CaseFailed(Exception):
    """Raised by a case's checker with a one-line description of what is wrong."""


# ---- comparing arrays, with a description a student can act on ------------------------------------

def expect_close(name: str, got, want: np.ndarray, rtol: float = 1e-4, atol: float = 1e-5) -> str:
    """Raise CaseFailed unless `got` has want's shape and values; else return a one-line summary."""
    if not isinstance(got, np.ndarray):
        raise CaseFailed(f"{name} is a {type(got).__name__}, expected a numpy array of shape {list(want.shape)}")
    if got.shape != want.shape:
        raise CaseFailed(f"{name} has shape {list(got.shape)}, expected {list(want.shape)}")
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    scale = max(1.0, float(np.abs(want).max()))
    worst = np.unravel_index(int(np.nanargmax(np.where(np.isnan(err), np.inf, err))), err.shape)
    max_err = float(err[worst]) if not np.isnan(err[worst]) else float("nan")
    if not np.all(np.isfinite(got)) and np.all(np.isfinite(want)):
        raise CaseFailed(f"{name} has NaN/inf values (first at index {list(np.argwhere(~np.isfinite(got))[0])})")
    if not np.allclose(got, want, rtol=rtol, atol=atol * scale):
        raise CaseFailed(f"{name}: max abs error {max_err:.3g} at index {list(map(int, worst))} "
                         f"(got {float(got[worst]):.6g}, expected {float(want[worst]):.6g}; "
                         f"tolerance {atol * scale:.1g} + {rtol:g}·|expected|)")
    return f"{name} {list(got.shape)} max abs error {max_err:.1e}"


def expect_unchanged(name: str, before: np.ndarray, after: np.ndarray) -> None:
    if not np.array_equal(before, after):
        raise CaseFailed(f"modified its input {name} in place; compute a new array instead")


def _expect_tuple(got, n: int, names: str) -> tuple:
    if not (isinstance(got, tuple) and len(got) == n):
        raise CaseFailed(f"returned {type(got).__name__}, expected a tuple ({names})")
    for name, a in zip(names.split(", "), got):
        if not isinstance(a, np.ndarray):
            raise CaseFailed(f"{name} is a {type(a).__name__}, expected a numpy array")
    return got
