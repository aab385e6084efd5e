"""A teacher's tools: the exercise list with a student's status, the handout (the stubs and nothing
else) and the reference solutions. Grading a class is grading.py.

    lessons/exercises/exNN_name.py            the stubs students fill in (what the handout copies)
    lessons/exercises/solutions/exNN_name.py  a reference solution for every exercise (never handed out)
"""
from __future__ import annotations

import ast
import shutil
from dataclasses import dataclass
from pathlib import Path

from minillm.errors import MiniLLMError
from minillm.course.grader import check_exercise, exercise_path
from minillm.course.lessons import EXERCISES_DIR
from minillm.course.registry import EXERCISES

SOLUTIONS_DIR = EXERCISES_DIR / "solutions"


# ---- the stubs, the solutions, the list ---------------------------------------------------------------

def is_stub(path: Path, function: str) -> bool:
    """True when `function` in the file is still only a docstring and `raise NotImplementedError`."""
    try:
        tree = ast.parse(Path(path).read_text())
    except SyntaxError:
        return False
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == function:
            body = node.body[1:] if _is_docstring(node.body[0]) else node.body
            return len(body) == 1 and isinstance(body[0], ast.Raise) and "NotImplementedError" in ast.unparse(body[0])
    return False


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def solution_path(number: int) -> Path | None:
    """The reference solution of exercise `number` (lessons/exercises/solutions/exNN_*.py), if there is one."""
    matches = sorted(SOLUTIONS_DIR.glob(f"ex{number:02d}_*.py"))
    return matches[0] if matches else None


@dataclass
class ExerciseStatus:
    number: int
    lesson: int
    function: str
    file: str
    status: str            # "not written" / "passed 5/5" / "failing 2 of 5" / "does not load: ..."
    passed: bool = False


def exercise_list(folder: Path | None = None) -> list[ExerciseStatus]:
    """Every exercise with its lesson and the status of the student's file (in `folder`, default
    lessons/exercises/). Written files are graded in this process: it is the student's own code."""
    rows = []
    for number, ex in sorted(EXERCISES.items()):
        path = _student_file(number, folder)
        if path is None:
            rows.append(ExerciseStatus(number, ex.lesson, ex.function, "-", "no file"))
            continue
        if is_stub(path, ex.function):
            rows.append(ExerciseStatus(number, ex.lesson, ex.function, path.name, "not written"))
            continue
        try:
            report = check_exercise(number, path)
        except Exception as e:  # noqa: BLE001 - a file that does not load is a status, not a crash
            where = f", line {e.lineno}" if isinstance(e, SyntaxError) else ""
            rows.append(ExerciseStatus(number, ex.lesson, ex.function, path.name,
                                       f"does not load: {type(e).__name__}{where}"))
            continue
        total = len(ex.cases())
        n_ok = sum(c.passed for c in report.cases)
        status = f"passed {n_ok}/{total}" if report.passed else f"failing {total - n_ok} of {total}"
        if report.note and not report.passed:
            status = ("not written" if "not written yet" in report.note else report.note
                      if report.note.startswith("does not load") else f"failing: {report.note}")
        rows.append(ExerciseStatus(number, ex.lesson, ex.function, path.name, status, report.passed))
    return rows


def _student_file(number: int, folder: Path | None) -> Path | None:
    if folder is None:
        try:
            return exercise_path(number)
        except MiniLLMError:
            return None
    matches = sorted(Path(folder).glob(f"ex{number:02d}_*.py"))
    return matches[0] if matches else None


def write_handout(dest: str | Path) -> list[Path]:
    """Copy every exercise's stub (and nothing else: no solutions, no graders) into `dest`.

    Refuses a stub that is no longer a stub (someone filled in lessons/exercises/ in this checkout),
    and refuses to overwrite a different file already in `dest`."""
    dest = Path(dest)
    plan = []
    for number, ex in sorted(EXERCISES.items()):
        src = exercise_path(number)
        if not is_stub(src, ex.function):
            raise MiniLLMError(f"{src} is not a stub any more ({ex.function}() has code in it): restore it "
                               f"(git checkout {src.relative_to(EXERCISES_DIR.parents[1])}) before writing a handout")
        target = dest / src.name
        if target.exists() and target.read_bytes() != src.read_bytes():
            raise MiniLLMError(f"{target} exists and differs from the stub: choose an empty folder")
        plan.append((src, target))
    if dest.exists() and not dest.is_dir():
        raise MiniLLMError(f"{dest} is a file, not a folder")
    dest.mkdir(parents=True, exist_ok=True)
    for src, target in plan:
        shutil.copyfile(src, target)
    return [target for _, target in plan]


# ---- what `minillm exercise list` prints --------------------------------------------------------------------------------

def format_exercise_list(rows: list[ExerciseStatus]) -> str:
    """`minillm exercise list`: one line per exercise: number, lesson, function, file, status."""
    width = max(len(r.function) for r in rows)
    lines = [f"{r.number:02d}  lesson {r.lesson:02d}  {r.function:<{width}}  {r.status:<20}  {r.file}" for r in rows]
    done = sum(r.passed for r in rows)
    return "\n".join(lines + [f"{done} of {len(rows)} exercises pass"])
