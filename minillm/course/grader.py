"""The exercise grader: find a student's `exNN_name.py` (in their handout folder, or a checkout's
lessons/exercises/), run every case of the exercise on its function, and report each case's verdict.

`minillm exercise check N` and `pytest lessons/exercises --exercise N` both call `check_exercise`."""
from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Callable

from minillm.errors import MiniLLMError
from minillm.course.cases import Case, CaseFailed, NotGraded, SubmissionStopped, drawing, exercise_id, hidden_cases
from minillm.course.lessons import EXERCISES_DIR
from minillm.course.registry import EXERCISES
from minillm.resources import is_checkout

HANDOUT_HINT = "`minillm exercise handout DIR` writes the exercises into a folder of yours; run this command in DIR"
EXERCISE_FILE = re.compile(r"ex(\d\d(?:\.\d+)?)_\w+\.py")     # ex07_sliding_window_mask.py, ex17.2_schedule_step.py


@dataclass
class CaseResult:
    name: str
    passed: bool
    detail: str


@dataclass
class Report:
    number: str                      # the exercise's id: '07', '17.2'
    function: str
    source: str
    cases: list[CaseResult] = field(default_factory=list)
    note: str = ""       # a message for the whole exercise (not written yet, not found, ...)
    seed: int | None = None          # the seed of its hidden cases, when it ran some

    @property
    def passed(self) -> bool:
        return bool(self.cases) and all(c.passed for c in self.cases) and not self.note

    @property
    def failures(self) -> list[CaseResult]:
        return [c for c in self.cases if not c.passed]

    def __str__(self) -> str:
        lines = [f"exercise {self.number}: {self.function} ({self.source})"]
        lines += [f"  {'PASS' if c.passed else 'FAIL'}  {c.name}: {c.detail}" for c in self.cases]
        if self.note:
            lines.append(f"  {self.note}")
        n_ok = sum(c.passed for c in self.cases)
        verdict = "passed" if self.passed else "FAILED"
        if self.note.startswith("not graded"):              # a GPU exercise without a GPU: neither pass nor fail
            verdict = "NOT GRADED"
        lines.append(f"{verdict}: {n_ok}/{len(self.cases)} cases" if self.cases else f"{verdict}: no case ran")
        if self.seed is not None:
            lines.append(f"hidden cases drawn with --seed {self.seed}")
        return "\n".join(lines)


def exercise_cases(number: int | str, seed: int | None = None) -> list[Case]:
    """The cases exercise `number` is graded on: its public ones, and with `seed` its hidden ones."""
    exercise = _exercise(number)
    return exercise.cases() + (hidden_cases(exercise, seed) if seed is not None else [])


def check_exercise(number: int | str, module: ModuleType | Callable | str | Path | None = None,
                   seed: int | None = None, cases: list[Case] | None = None) -> Report:
    """Grade exercise `number` (7, '07', '17.2'): the student's file by default (`student_file`), or a
    given module, file or function, on its public cases and, with `seed`, hidden ones drawn from it."""
    exercise = _exercise(number)
    try:
        fn, source = _student_function(exercise, module)
    except StudentFileError as e:                # the file does not even import: a failed check, not a crash
        report = Report(exercise.id, exercise.function, e.source)
        report.note = f"does not load: {e}"
        return report
    report = Report(exercise.id, exercise.function, source, seed=seed)
    if fn is None:
        report.note = f"{source} has no function {exercise.function}()"
        return report
    for case in cases if cases is not None else exercise_cases(number, seed):
        try:
            with drawing(case.draw):
                detail = exercise.check(fn, case)
            report.cases.append(CaseResult(case.name, True, detail))
        except NotGraded as e:                   # never a pass: the report says why no case ran
            report.cases.clear()
            report.note = f"not graded ({e})"
            break
        except NotImplementedError:
            report.cases.append(CaseResult(case.name, False, "raised NotImplementedError"))
            report.note = (f"{exercise.function}() is not written yet: open {source}, read the docstring, "
                           f"and replace `raise NotImplementedError` with your code")
            break
        except (CaseFailed, SubmissionStopped) as e:
            report.cases.append(CaseResult(case.name, False, str(e)))
        except Exception as e:  # a student's bug is a failed case, not a crash of the grader
            report.cases.append(CaseResult(case.name, False, f"raised {type(e).__name__}: {e}"))
    return report


def _exercise(number: int | str):
    if number not in EXERCISES:
        raise MiniLLMError(f"no exercise {exercise_id(number)} (exercises: {', '.join(EXERCISES)})")
    return EXERCISES[number]


def exercise_files(folder: Path, number: int | str | None = None) -> list[Path]:
    """The exercise files in `folder` (exNN_name.py, exNN.P_name.py), or those of exercise `number`."""
    want = None if number is None else exercise_id(number)
    return sorted(p for p in Path(folder).glob("ex*_*.py")
                  if (m := EXERCISE_FILE.fullmatch(p.name)) and (want is None or exercise_id(m[1]) == want))


def exercise_path(number: int | str) -> Path:
    """The stub of exercise `number` that minillm ships (lessons/exercises/exNN_*.py): what a handout copies."""
    matches = exercise_files(EXERCISES_DIR, number)
    if not matches:
        raise MiniLLMError(f"no file lessons/exercises/ex{exercise_id(number)}_*.py in {EXERCISES_DIR}")
    return matches[0]


def student_folder(folder: str | Path | None = None) -> Path:
    """Where the student's exercise files are: `folder`; else the current folder when it holds an
    exNN_*.py (a handout); else a checkout's lessons/exercises/. An installed wheel's copies sit among
    the package's files, not for editing, so there the student is pointed at `exercise handout`."""
    if folder is not None:
        return Path(folder)
    here = Path.cwd()
    if exercise_files(here):
        return here
    if is_checkout():
        return EXERCISES_DIR
    raise MiniLLMError(f"no exercise files (exNN_*.py) in this folder: {HANDOUT_HINT} (or give --folder DIR)")


def student_file(number: int | str, folder: str | Path | None = None) -> Path:
    """The file `minillm exercise check N` grades: exNN_*.py in the student's folder (`student_folder`)."""
    id_ = _exercise(number).id
    where = student_folder(folder)
    matches = exercise_files(where, id_)
    if not matches:
        raise MiniLLMError(f"no ex{id_}_*.py in {display_path(where)}/: the handout's file for exercise "
                           f"{id_} is {exercise_path(id_).name}")
    return matches[0]


class StudentFileError(MiniLLMError):
    """A student's file that does not import (a syntax error, a missing module): says the file and line."""

    def __init__(self, message: str, source: str):
        super().__init__(message)
        self.source = source


def load_exercise(number: int | str, path: str | Path | None = None) -> ModuleType:
    """Import a student's exercise file (default: `student_file`) as a fresh module (edits are picked up
    every time). A file that does not import raises StudentFileError naming the line, not the traceback."""
    path = Path(path) if path is not None else student_file(number)
    if path.suffix != ".py":
        raise MiniLLMError(f"{path}: an exercise is a Python file (exNN_name.py)")
    spec = importlib.util.spec_from_file_location(f"minillm_exercise_{exercise_id(number).replace('.', '_')}", path)
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
        path = Path(module) if module is not None else student_file(exercise.id)
        module = load_exercise(exercise.id, path)
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
