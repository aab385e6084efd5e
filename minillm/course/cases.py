"""What an exercise is made of: its cases, and the checks that compare a student's answer with the
engine's and raise CaseFailed with a description a student can act on."""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np


@dataclass(frozen=True)
class Case:
    name: str
    inputs: dict
    draw: int | None = None       # a hidden case: the seed its random values were drawn with


@dataclass(frozen=True)
class Exercise:
    number: int
    function: str                          # the function the student writes
    lesson: int
    reference: Callable                    # the engine's solution, same signature as the student's
    cases: Callable[[], list[Case]]
    check: Callable[[Callable, Case], str]  # run one case; raise CaseFailed or return a summary
    part: int = 1                           # 17.2 is lesson 17's second exercise (its file: ex17.2_name.py)
    hidden: Callable[[int], list[Case]] | None = None   # fresh cases from a seed, where `cases` draws nothing
    draws_in_check: bool = False            # its check draws its values with case_rng (so hidden cases differ)
    points: float = 1.0                     # what passing every case is worth in a teacher's report
    needs_gpu: bool = False                 # its check runs the answer on a GPU: elsewhere "not graded (no GPU)"

    @property
    def id(self) -> str:
        """'07' for lesson 7's exercise, '17.2' for lesson 17's second one."""
        return f"{self.number:02d}" if self.part == 1 else f"{self.number:02d}.{self.part}"


class CaseFailed(Exception):
    """Raised by a case's checker with a one-line description of what is wrong."""


class NotGraded(Exception):
    """The exercise cannot be graded on this machine (a GPU exercise without a GPU): never a pass."""


class SubmissionStopped(BaseException):
    """The student's process stopped answering (time limit, crash, a malformed answer): the case fails.
    A BaseException, so a check's `except Exception` around the student's call cannot swallow it."""


# ---- hidden cases: the public cases' random values, drawn afresh from a seed --------------------------

_draw: ContextVar[int | None] = ContextVar("hidden_case_draw", default=None)
_drawn: ContextVar[list | None] = ContextVar("hidden_case_draws_seen", default=None)


def case_rng(*key: int) -> np.random.Generator:
    """The generator an exercise's cases and checks draw their values from: fixed by `key` for the
    public cases; `key` mixed with the grading run's seed inside `drawing(seed)` (the hidden cases)."""
    seen = _drawn.get()
    if seen is not None:
        seen.append(key)
    seed = _draw.get()
    return np.random.default_rng(key[0] if len(key) == 1 and seed is None else
                                 [*map(int, key)] + ([] if seed is None else [seed]))


@contextmanager
def drawing(seed: int | None) -> Iterator[None]:
    """Within it, case_rng draws the hidden values of `seed` (None: the public ones)."""
    token = _draw.set(seed)
    try:
        yield
    finally:
        _draw.reset(token)


def hidden_cases(exercise: "Exercise", seed: int) -> list[Case]:
    """The exercise's cases with fresh random values drawn from `seed` (the same for every student of a
    grading run): an answer that only recalls the public cases fails them. An exercise whose cases
    draw nothing at random gets its own `hidden(seed)` cases, or none."""
    if exercise.hidden is not None:
        return [Case(f"hidden: {c.name}", c.inputs, seed) for c in exercise.hidden(seed)]
    seen: list = []
    token, mark = _draw.set(seed), _drawn.set(seen)
    try:
        cases = exercise.cases()
    finally:
        _draw.reset(token)
        _drawn.reset(mark)
    if not seen and not exercise.draws_in_check:
        return []
    return [Case(f"hidden: {c.name}", c.inputs, seed) for c in cases]


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


# ---- exercise ids: "07", "17.2" ---------------------------------------------------------------------------

def exercise_id(key: int | str) -> str:
    """The id of an exercise as the registry spells it: 7, '7', '07' -> '07'; '17.2' -> '17.2'."""
    text = str(key).strip()
    number, _, part = text.partition(".")
    if not number.isdigit() or (part and not part.isdigit()):
        return text                                      # not an id: the lookup then says which exist
    return f"{int(number):02d}" if not part or int(part) == 1 else f"{int(number):02d}.{int(part)}"


class ExerciseRegistry(dict):
    """Every exercise by id, in order ('01' ... '17', '17.2', '18' ...); an int or a str finds one."""

    def __init__(self, exercises):
        super().__init__(sorted(((e.id, e) for e in exercises), key=lambda item: _order(item[0])))

    def __getitem__(self, key):
        return super().__getitem__(exercise_id(key))

    def __contains__(self, key) -> bool:
        return super().__contains__(exercise_id(key))

    def get(self, key, default=None):
        return super().get(exercise_id(key), default)


def _order(id_: str) -> tuple[int, int]:
    number, _, part = id_.partition(".")
    return int(number), int(part or 1)
