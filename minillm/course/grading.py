"""Grading a class: a folder of submissions, each exercise of each student run in a confined process of its
own (remote.py) that only answers calls; the cases, the comparisons and the counts stay in this process.
Each run adds hidden cases drawn from a seed it prints. The grades go to a CSV (a row per student, a
column per exercise), a feedback text per student, and the reports of reports.py."""
from __future__ import annotations

import csv
import os
import secrets
import statistics
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from minillm.course.cases import Case, SubmissionStopped, exercise_id
from minillm.course.grader import EXERCISE_FILE, check_exercise, exercise_cases, exercise_files
from minillm.course.registry import EXERCISES
from minillm.course.remote import Submission, probe
from minillm.errors import MiniLLMError

MAX_FILE_BYTES = 1 << 20          # an exercise file is a page of Python, not a data set


@dataclass
class Limits:
    time_s: float = 30.0          # per exercise, wall clock, all its calls together
    memory_mb: int = 4096         # address space of a student's process
    jobs: int = 1                 # students graded at once
    max_answer_mb: int = 256      # the most one answer may carry back


class _CasesBySeed(dict):
    """Exercise id -> its public and hidden cases, drawn the first time an exercise is asked for."""

    def __init__(self, seed: int):
        super().__init__()
        self.seed = seed

    def __missing__(self, number: str) -> list[Case]:
        self[number] = exercise_cases(number, self.seed)
        return self[number]


@dataclass
class Plan:
    """What every student of one grading run is graded on, the same for all of them."""
    seed: int                                  # the hidden cases' seed (`--seed` reproduces them)
    cases: dict[str, list[Case]]               # exercise id -> public + hidden cases
    points: dict[str, float]                   # the exercises that count, and what each is worth
    isolation: str                             # how a student's process is shut in, in words
    unsafe: bool = False


@dataclass
class Graded:
    """One exercise of one student: cases passed of the total the grader ran, and what went wrong."""
    number: str
    file: str
    passed: int
    total: int
    failures: list[tuple[str, str]] = field(default_factory=list)   # (case, detail)
    note: str = ""
    points: float = 1.0                         # what all its cases are worth

    @property
    def cell(self) -> str:
        return f"{self.passed}/{self.total}"

    @property
    def complete(self) -> bool:
        return self.passed == self.total > 0 and not self.note

    @property
    def score(self) -> float:
        """Points earned: the exercise's points times the fraction of its cases passed."""
        return round(self.points * self.passed / self.total, 2) if self.total else 0.0


@dataclass
class StudentGrades:
    student: str
    exercises: dict[str, Graded] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)    # files that name no exercise
    isolation: str = "not started"
    seconds: float = 0.0

    def score(self, plan: Plan) -> float:
        return round(sum(g.score for n, g in self.exercises.items() if n in plan.points), 2)

    def feedback(self, plan: Plan | None = None) -> str:
        """The text a student gets: every exercise submitted, its failing cases, and what is missing."""
        done = sum(g.complete for g in self.exercises.values())
        lines = [f"{self.student}: {done} of {len(self.exercises)} submitted exercises pass "
                 f"({len(EXERCISES)} in the course)"]
        if plan is not None:
            lines[0] += f"; {self.score(plan):g} of {sum(plan.points.values()):g} points"
        lines.append("")
        for number, g in self.exercises.items():
            verdict = "passed" if g.complete else "FAILED"
            lines.append(f"exercise {number} {EXERCISES[number].function} ({g.file}): {verdict} {g.cell} cases"
                         f", {g.score:g} of {g.points:g} points")
            lines += [f"    FAIL  {case}: {detail}" for case, detail in g.failures]
            if g.note:
                lines.append(f"    {g.note}")
        missing = [n for n in (plan.points if plan is not None else EXERCISES) if n not in self.exercises]
        if missing:
            lines += ["", f"not submitted: {', '.join(missing)}"]
        if self.ignored:
            lines.append(f"ignored (no such exercise): {', '.join(self.ignored)}")
        seed = f"; hidden cases drawn with --seed {plan.seed}" if plan is not None else ""
        lines.append(f"graded in {self.seconds:.1f} s; isolation: {self.isolation}{seed}")
        return "\n".join(lines) + "\n"


@dataclass
class Gradebook:
    plan: Plan
    students: list[StudentGrades]


# ---- the submissions ---------------------------------------------------------------------------------------------

def find_submissions(root: str | Path) -> dict[str, dict[str, Path]]:
    """{student: {exercise id: file}} in `root`: one subfolder per student (exNN_*.py anywhere inside it),
    loose files named STUDENT_exNN_*.py (or STUDENT-exNN_...), or `root` itself when it holds exNN_*.py
    (one student, as Gradescope hands a submission over)."""
    root = Path(root)
    if not root.is_dir():
        raise MiniLLMError(f"{root} is not a folder of submissions (one subfolder per student)")
    if is_one_student(root):
        return {root.resolve().name: _files(root)}
    found: dict[str, dict[str, Path]] = {}
    for path in sorted(root.iterdir()):
        if path.is_dir() and not path.name.startswith((".", "__")):
            found[path.name] = _files(path)
        elif path.suffix == ".py":
            student, rest = _split_loose(path.name)
            if rest:
                found.setdefault(student or root.name, {})[exercise_id(EXERCISE_FILE.fullmatch(rest)[1])] = path
    if not found:
        raise MiniLLMError(f"no submissions in {root}: expected one subfolder per student with exNN_*.py files")
    return found


def is_one_student(root: Path) -> bool:
    """Whether `root` is one student's folder (exercise files at its top, no student subfolders)."""
    return bool(exercise_files(root)) and not any(
        p.is_dir() and not p.name.startswith((".", "__")) and _files(p) for p in root.iterdir())


def _files(folder: Path) -> dict[str, Path]:
    files = sorted(p for p in folder.rglob("ex*_*.py") if "__pycache__" not in p.parts
                   and EXERCISE_FILE.fullmatch(p.name))
    return {exercise_id(EXERCISE_FILE.fullmatch(p.name)[1]): p for p in reversed(files)}  # first in order wins


def _split_loose(name: str) -> tuple[str, str]:
    """'alice_ex01_rmsnorm.py' -> ('alice', 'ex01_rmsnorm.py'); a file naming no exercise -> ('', '')."""
    for i in range(len(name) - 4):
        if (i == 0 or name[i - 1] in "_-.") and EXERCISE_FILE.fullmatch(name[i:]):
            return name[:max(i - 1, 0)], name[i:]
    return "", ""


def refusal(path: Path, student_root: Path | None = None) -> str:
    """Why a submitted file is not graded at all ('' when it is): a link (to the solutions, say), a file
    that lies outside the student's folder, or one too big to be an exercise."""
    from minillm.course.classroom import SOLUTIONS_DIR
    if path.is_symlink():
        return f"refused: {path.name} is a symbolic link (to {os.readlink(path)}); hand in the file itself"
    if student_root is not None and not path.resolve().is_relative_to(student_root.resolve()):
        return f"refused: {path.name} lies outside the student's folder"
    if not path.is_file():
        return f"refused: {path.name} is not a regular file"
    if path.stat().st_size > MAX_FILE_BYTES:
        return f"refused: {path.name} is {path.stat().st_size / 2**20:.1f} MB, not an exercise file"
    if any(s.is_file() and os.path.samefile(path, s) for s in SOLUTIONS_DIR.glob("ex*.py")):
        return f"refused: {path.name} is the reference solution's own file (a hard link)"
    return ""


# ---- grading -------------------------------------------------------------------------------------------------------

def make_plan(seed: int | None = None, points: dict[str, float] | None = None, unsafe: bool = False) -> Plan:
    """The run's cases (public + hidden from `seed`, a fresh one by default) and points; checks first
    that a student's process can be confined here (raises Unisolated in one line unless `unsafe`)."""
    isolation = probe(unsafe)
    seed = secrets.randbelow(2**31) if seed is None else seed
    points = {exercise_id(n): float(p) for n, p in points.items()} if points is not None else \
        {n: ex.points for n, ex in EXERCISES.items()}
    unknown = [n for n in points if n not in EXERCISES]
    if unknown:
        raise MiniLLMError(f"points for no such exercise: {', '.join(unknown)} (exercises: {', '.join(EXERCISES)})")
    return Plan(seed, _CasesBySeed(seed), points, isolation, unsafe)


def read_points(path: str | Path) -> dict[str, float]:
    """A TOML file of `"07" = 2` lines: the exercises that count and their points."""
    try:
        table = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise MiniLLMError(f"{path}: not a points file ({e}); write one `\"07\" = 2` line per exercise") from None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in table.values()):
        raise MiniLLMError(f"{path}: points are numbers >= 0, one `\"07\" = 2` line per exercise")
    return table


def grade_folder(root: str | Path, csv_path: str | Path | None = None, feedback_dir: str | Path | None = None,
                 limits: Limits | None = None, plan: Plan | None = None) -> Gradebook:
    """Grade every student in `root`; write the CSV (a row per student, a column per exercise: cases
    passed/total, empty if not submitted; then exercises passed and points) and a feedback text each."""
    limits, plan = limits or Limits(), plan or make_plan()
    submissions = find_submissions(root)
    with ThreadPoolExecutor(max_workers=max(1, limits.jobs)) as pool:
        students = list(pool.map(lambda item: grade_student(item[0], item[1], limits, plan), submissions.items()))
    book = Gradebook(plan, students)
    if csv_path is not None:
        write_csv(book, csv_path)
    if feedback_dir is not None:
        feedback_dir = Path(feedback_dir)
        feedback_dir.mkdir(parents=True, exist_ok=True)
        for g in students:
            (feedback_dir / f"{g.student}.txt").write_text(g.feedback(plan))
    return book


def write_csv(book: Gradebook, path: str | Path) -> None:
    numbers = list(EXERCISES)
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["student"] + [f"ex{n}" for n in numbers] + ["exercises passed", "points", "max points"])
        max_points = sum(book.plan.points.values())
        for g in book.students:
            cells = [g.exercises[n].cell if n in g.exercises else "" for n in numbers]
            out.writerow([g.student] + cells + [sum(x.complete for x in g.exercises.values()),
                                                f"{g.score(book.plan):g}", f"{max_points:g}"])


def grade_student(student: str, files: dict[str, Path], limits: Limits, plan: Plan) -> StudentGrades:
    """Grade one student's files, each exercise in a process of its own: one that dies, hangs or sends
    garbage costs the case it was on (or, past its time, the rest of that exercise), nothing more."""
    grades = StudentGrades(student, isolation=plan.isolation)
    start = time.monotonic()
    roots = {p: p.parent for p in files.values()}
    for number, path in sorted(files.items(), key=lambda item: list(EXERCISES).index(item[0])
                               if item[0] in EXERCISES else 10**6):
        if number not in EXERCISES:
            grades.ignored.append(path.name)
            continue
        grades.exercises[number] = grade_exercise(number, path, limits, plan, roots[path])
    grades.seconds = time.monotonic() - start
    return grades


def grade_exercise(number: str, path: Path, limits: Limits, plan: Plan, student_root: Path | None = None) -> Graded:
    """One file on the plan's cases, through a confined process: the verdicts are computed here."""
    exercise, cases = EXERCISES[number], plan.cases[number]
    graded = Graded(number, path.name, 0, len(cases), points=plan.points.get(number, 0.0))
    graded.note = refusal(path, student_root)
    if graded.note:
        return graded
    submission = Submission(path, exercise.function, limits.time_s, limits.memory_mb, limits.max_answer_mb,
                            plan.unsafe)
    try:
        submission.start()
        if submission.load_error:
            graded.note = f"does not load: {submission.load_error}"
            return graded
        report = check_exercise(number, submission, cases=cases)
    except SubmissionStopped as e:
        graded.note = f"not graded: {e}"
        return graded
    finally:
        submission.close()
    graded.passed = sum(c.passed for c in report.cases)            # counted here, of cases run here
    graded.failures = [(c.name, c.detail) for c in report.failures]
    graded.note = report.note
    return graded


def format_grades(book: Gradebook, csv_path=None, feedback_dir=None, written: list[Path] = ()) -> str:
    """`minillm exercise grade`: a line per student, then the seed, the isolation and the files written."""
    grades, plan = book.students, book.plan
    width = max(len(g.student) for g in grades)
    lines = []
    for g in grades:
        done = sum(x.complete for x in g.exercises.values())
        failed = [n for n, x in g.exercises.items() if not x.complete]
        lines.append(f"{g.student:<{width}}  {g.score(plan):g}/{sum(plan.points.values()):g} points  "
                     f"{done}/{len(g.exercises)} submitted exercises pass"
                     f"{'  (failing: ' + ', '.join(failed) + ')' if failed else ''}  [{g.seconds:.1f} s]")
    lines.append(f"hidden cases drawn with --seed {plan.seed} (give it again to grade on the same cases)")
    lines.append(f"isolation: {plan.isolation}")
    if csv_path is not None:
        lines.append(f"wrote {csv_path} ({len(grades)} student{'s' if len(grades) != 1 else ''})")
    if feedback_dir is not None:
        lines.append(f"wrote feedback for each student into {feedback_dir}/")
    lines += [f"wrote {p}" for p in written]
    return "\n".join(lines)


def class_statistics(book: Gradebook) -> list[dict]:
    """Per exercise: submitted, complete, mean and median points over the class, the case most failed."""
    rows = []
    for number in EXERCISES:
        graded = [s.exercises[number] for s in book.students if number in s.exercises]
        if not graded and number not in book.plan.points:
            continue
        scores = [s.exercises[number].score if number in s.exercises else 0.0 for s in book.students]
        failed: dict[str, int] = {}
        for g in graded:
            for case, _ in g.failures:
                failed[case] = failed.get(case, 0) + 1
        hardest = max(failed.items(), key=lambda kv: kv[1]) if failed else None
        rows.append(dict(number=number, function=EXERCISES[number].function,
                         points=book.plan.points.get(number, 0.0), submitted=len(graded),
                         complete=sum(g.complete for g in graded), mean=round(statistics.fmean(scores), 2),
                         median=round(statistics.median(scores), 2),
                         hardest=f"{hardest[0]} ({hardest[1]} student{'s' if hardest[1] > 1 else ''})"
                         if hardest else ""))
    return rows
