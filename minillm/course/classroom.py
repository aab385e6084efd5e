"""A teacher's tools: the exercise list with a student's status, the handout (the stubs, a README, and
nothing else) and the reference solutions. Grading a class is grading.py.

    lessons/exercises/exNN_name.py            the stubs students fill in (what the handout copies)
    lessons/exercises/solutions/exNN_name.py  a reference solution for every exercise (never handed out)
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from minillm.errors import MiniLLMError
from minillm.course.grader import display_path, check_exercise, exercise_files, exercise_path, student_folder
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


def solution_path(number: int | str) -> Path | None:
    """The reference solution of exercise `number` (lessons/exercises/solutions/exNN_*.py), if there is one."""
    matches = exercise_files(SOLUTIONS_DIR, number)
    return matches[0] if matches else None


@dataclass
class ExerciseStatus:
    number: str            # the exercise's id: '07', '17.2'
    lesson: int
    function: str
    file: str
    status: str            # "not written" / "passed 5/5" / "failing 2 of 5" / "does not load: ..."
    passed: bool = False


def exercise_list(folder: str | Path | None = None) -> list[ExerciseStatus]:
    """Every exercise with its lesson and the status of the student's file (in `folder`, default: the
    student's folder, see `student_folder`). Written files are graded in this process: it is the
    student's own code."""
    folder = student_folder(folder)
    rows = []
    for number, ex in EXERCISES.items():
        matches = exercise_files(folder, number)
        path = matches[0] if matches else None
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
                      if report.note.startswith(("does not load", "not graded")) else f"failing: {report.note}")
        rows.append(ExerciseStatus(number, ex.lesson, ex.function, path.name, status, report.passed))
    return rows


def write_handout(dest: str | Path) -> list[Path]:
    """Copy every exercise's stub into `dest`, with a README.md on checking and submitting them (and
    nothing else: no solutions, no graders). -> the stubs written.

    Refuses a stub that is no longer a stub (someone filled in lessons/exercises/ in this checkout),
    and refuses to overwrite a different file already in `dest`."""
    dest = Path(dest)
    plan = []
    for number, ex in EXERCISES.items():
        src = exercise_path(number)
        if not is_stub(src, ex.function):
            raise MiniLLMError(f"{src} is not a stub any more ({ex.function}() has code in it): restore it "
                               f"(git checkout {src.relative_to(EXERCISES_DIR.parents[1])}) before writing a handout")
        plan.append((src.read_bytes(), dest / src.name))
    plan.append((handout_readme().encode(), dest / "README.md"))
    for content, target in plan:
        if target.exists() and target.read_bytes() != content:
            raise MiniLLMError(f"{target} exists and differs from the handout's: choose an empty folder")
    if dest.exists() and not dest.is_dir():
        raise MiniLLMError(f"{dest} is a file, not a folder")
    dest.mkdir(parents=True, exist_ok=True)
    for content, target in plan:
        target.write_bytes(content)
    return [target for _, target in plan[:-1]]


HANDOUT_README = """\
# minillm exercises

One exercise per lesson of minillm's course. In each `exNN_name.py`, write the function whose body is
`raise NotImplementedError`: its docstring gives the shapes and the contract. The grader runs your
function on random inputs and compares it with the engine's own code.

## Check your work

In this folder:

    minillm exercise check 1     # grade ex01_rmsnorm.py: each case, and by how much a failing one is off
    minillm exercise list        # every exercise here: not written / failing n of m / passed
    python ex01_rmsnorm.py       # the same check as `minillm exercise check 1`

From another folder, name this one with `--folder PATH` (`check` and `list` take it). The lessons that
go with the exercises: `minillm lesson` lists them, `minillm lesson 1` runs one.

## Run the real model on your pieces (student mode)

Once your RMSNorm, KV-cache write, attention and RoPE pass (exercises 01, 02, 02.2, 03; top-p 04 too),
run SmolLM2 on them:

    minillm generate --student . --no-chat "The capital of France is"

Your functions replace the engine's inside the forward pass (with `--quant int8`, your exercise 08
quantizer too; `minillm serve --student .` batches on your 16 and 17 as well), the engine's own run
beside them on the same tokens, and it prints the largest logit difference (tolerance 1e-3), which of
your pieces this run used and which it did not, and, when they differ, the first layer and position
where your hidden state left the engine's. A stub not written yet is left to the engine. This run
imports your files into the minillm process (it is not confined like grading): your own check, local
and ungraded.

Some exercises (15.2, 17.2, 18.2, 20.2) ask for a mechanism, not a formula: your function gets the
state as data and returns its decision; the grader applies it to its own engine objects, step by step.
12.2 is a CUDA kernel: it is graded on a GPU machine only ("not graded (no GPU)" elsewhere).

## Submit

Hand in your `exNN_*.py` files as they are, with their names unchanged: this whole folder, or the
files you finished. Your teacher grades a folder per student with `minillm exercise grade`, which runs
the same cases as `minillm exercise check` and hidden ones with fresh random values (try some with
`minillm exercise check 1 --seed 5`). It runs your file alone, in a process that may import only
Python's standard library and NumPy and read no other file: keep each exercise in its own file.

## The exercises

| # | lesson | file | you write |
|---|---|---|---|
"""


def handout_readme() -> str:
    """The README.md of a handout: how to check an exercise and how to hand it in, and the exercises."""
    rows = [f"| {n} | {ex.lesson:02d} | `{exercise_path(n).name}` | `{ex.function}` |"
            for n, ex in EXERCISES.items()]
    return HANDOUT_README + "\n".join(rows) + "\n"


# ---- what `minillm exercise list` prints --------------------------------------------------------------------------------

def format_exercise_list(rows: list[ExerciseStatus], folder: str | Path | None = None) -> str:
    """`minillm exercise list`: the folder listed, then one line per exercise: number, lesson, function,
    status, file."""
    width, id_width = max(len(r.function) for r in rows), max(len(r.number) for r in rows)
    header = [f"exercises in {display_path(Path(folder))}/"] if folder is not None else []
    lines = header + [f"{r.number:<{id_width}}  lesson {r.lesson:02d}  {r.function:<{width}}  {r.status:<20}  {r.file}"
                      for r in rows]
    done = sum(r.passed for r in rows)
    return "\n".join(lines + [f"{done} of {len(rows)} exercises pass"])
