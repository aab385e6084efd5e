"""The exercise grader: find a student's `exNN_name.py` (in their handout folder, or a checkout's
lessons/exercises/), run every case of the exercise on its function, and report each case's verdict.

`minillm exercise check N` and `pytest lessons/exercises --exercise N` both call `check_exercise`."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Callable

from minillm.errors import MiniLLMError
from minillm.course.cases import CaseFailed
from minillm.course.lessons import EXERCISES_DIR
from minillm.course.registry import EXERCISES
from minillm.resources import is_checkout

HANDOUT_HINT = "`minillm exercise handout DIR` writes the exercises into a folder of yours; run this command in DIR"


@dataclass
class CaseResult:
    name: str
    passed: bool
    detail: str


@dataclass
class Report:
    number: int
    function: str
    source: str
    cases: list[CaseResult] = field(default_factory=list)
    note: str = ""       # a message for the whole exercise (not written yet, not found, ...)

    @property
    def passed(self) -> bool:
        return bool(self.cases) and all(c.passed for c in self.cases) and not self.note

    @property
    def failures(self) -> list[CaseResult]:
        return [c for c in self.cases if not c.passed]

    def __str__(self) -> str:
        lines = [f"exercise {self.number:02d}: {self.function} ({self.source})"]
        lines += [f"  {'PASS' if c.passed else 'FAIL'}  {c.name}: {c.detail}" for c in self.cases]
        if self.note:
            lines.append(f"  {self.note}")
        n_ok = sum(c.passed for c in self.cases)
        verdict = "passed" if self.passed else "FAILED"
        lines.append(f"{verdict}: {n_ok}/{len(self.cases)} cases" if self.cases else f"{verdict}: no case ran")
        return "\n".join(lines)


def check_exercise(number: int, module: ModuleType | Callable | str | Path | None = None) -> Report:
    """Grade exercise `number`: the student's file by default (`student_file`), or a given module, file
    or function."""
    exercise = _exercise(number)
    try:
        fn, source = _student_function(exercise, module)
    except StudentFileError as e:                # the file does not even import: a failed check, not a crash
        report = Report(number, exercise.function, e.source)
        report.note = f"does not load: {e}"
        return report
    report = Report(number, exercise.function, source)
    if fn is None:
        report.note = f"{source} has no function {exercise.function}()"
        return report
    for case in exercise.cases():
        try:
            detail = exercise.check(fn, case)
            report.cases.append(CaseResult(case.name, True, detail))
        except NotImplementedError:
            report.cases.append(CaseResult(case.name, False, "raised NotImplementedError"))
            report.note = (f"{exercise.function}() is not written yet: open {source}, read the docstring, "
                           f"and replace `raise NotImplementedError` with your code")
            break
        except CaseFailed as e:
            report.cases.append(CaseResult(case.name, False, str(e)))
        except Exception as e:  # a student's bug is a failed case, not a crash of the grader
            report.cases.append(CaseResult(case.name, False, f"raised {type(e).__name__}: {e}"))
    return report


def _exercise(number: int):
    if number not in EXERCISES:
        raise MiniLLMError(f"no exercise {number:02d} (exercises: {', '.join(f'{n:02d}' for n in EXERCISES)})")
    return EXERCISES[number]


def exercise_path(number: int) -> Path:
    """The stub of exercise `number` that minillm ships (lessons/exercises/exNN_*.py): what a handout copies."""
    matches = sorted(EXERCISES_DIR.glob(f"ex{number:02d}_*.py"))
    if not matches:
        raise MiniLLMError(f"no file lessons/exercises/ex{number:02d}_*.py in {EXERCISES_DIR}")
    return matches[0]


def student_folder(folder: str | Path | None = None) -> Path:
    """Where the student's exercise files are: `folder`; else the current folder when it holds an
    exNN_*.py (a handout); else a checkout's lessons/exercises/. An installed wheel's copies sit among
    the package's files, not for editing, so there the student is pointed at `exercise handout`."""
    if folder is not None:
        return Path(folder)
    here = Path.cwd()
    if any(here.glob("ex[0-9][0-9]_*.py")):
        return here
    if is_checkout():
        return EXERCISES_DIR
    raise MiniLLMError(f"no exercise files (exNN_*.py) in this folder: {HANDOUT_HINT} (or give --folder DIR)")


def student_file(number: int, folder: str | Path | None = None) -> Path:
    """The file `minillm exercise check N` grades: exNN_*.py in the student's folder (`student_folder`)."""
    _exercise(number)
    where = student_folder(folder)
    matches = sorted(where.glob(f"ex{number:02d}_*.py"))
    if not matches:
        raise MiniLLMError(f"no ex{number:02d}_*.py in {display_path(where)}/: the handout's file for exercise "
                           f"{number:02d} is {exercise_path(number).name}")
    return matches[0]


class StudentFileError(MiniLLMError):
    """A student's file that does not import (a syntax error, a missing module): says the file and line."""

    def __init__(self, message: str, source: str):
        super().__init__(message)
        self.source = source


def load_exercise(number: int, path: str | Path | None = None) -> ModuleType:
    """Import a student's exercise file (default: `student_file`) as a fresh module (edits are picked up
    every time). A file that does not import raises StudentFileError naming the line, not the traceback."""
    path = Path(path) if path is not None else student_file(number)
    if path.suffix != ".py":
        raise MiniLLMError(f"{path}: an exercise is a Python file (exNN_name.py)")
    spec = importlib.util.spec_from_file_location(f"minillm_exercise_{number:02d}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:                     # IndentationError and TabError too: the file never ran
        where = "" if e.filename and Path(e.filename).resolve() == path.resolve() else f" (in {e.filename})"
        raise StudentFileError(f"line {e.lineno}{where}: {type(e).__name__}: {e.msg}", display_path(path)) from None
    except Exception as e:  # its top level raised: `import` of a missing module, a NameError, ... (not Ctrl-C)
        raise StudentFileError(f"line {_student_line(e, path)}: {type(e).__name__}: {e}", display_path(path)) from None
    return module


def _student_line(error: BaseException, path: Path) -> int | str:
    """The last line of the student's file in the error's traceback (where their code raised)."""
    line, target, tb = "?", str(path.resolve()), error.__traceback__
    while tb is not None:
        if str(Path(tb.tb_frame.f_code.co_filename).resolve()) == target:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _student_function(exercise, module) -> tuple[Callable | None, str]:
    if module is None or isinstance(module, (str, Path)):
        path = Path(module) if module is not None else student_file(exercise.number)
        module = load_exercise(exercise.number, path)
        source = display_path(path)
    elif isinstance(module, ModuleType):
        source = display_path(Path(module.__file__)) if getattr(module, "__file__", None) else module.__name__
    else:
        return module, getattr(module, "__qualname__", repr(module))   # a function given directly
    return getattr(module, exercise.function, None), source


def display_path(path: Path) -> str:
    """The path as the student would type it: from the current folder when it is inside, else in full."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(path.resolve())
