"""Grading a class: a folder of submissions, each student in a sandboxed subprocess (sandbox.py) with a
time limit, a memory limit and no network where the OS allows; a CSV with a row per student and a
column per exercise, and a feedback text per student with the failing cases."""
from __future__ import annotations

import csv
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from minillm.errors import MiniLLMError
from minillm.course.registry import EXERCISES

SANDBOX = Path(__file__).with_name("sandbox.py")
PACKAGE_ROOT = Path(__file__).resolve().parents[2]        # the folder holding minillm/, for the sandbox
STARTUP_S = 20.0           # a child's Python + NumPy + minillm start, on a busy machine
GRACE_S = 3.0              # past an exercise's limit before the child is killed (its alarm failed)


# ---- the submissions, the grades -----------------------------------------------------------------------

@dataclass
class Limits:
    time_s: float = 30.0          # per exercise, wall clock
    memory_mb: int = 4096         # address space of a student's process
    jobs: int = 1                 # students graded at once


@dataclass
class Graded:
    """One exercise of one student: cases passed of the exercise's total, and what went wrong."""
    number: int
    file: str
    passed: int
    total: int
    failures: list[tuple[str, str]] = field(default_factory=list)   # (case, detail)
    note: str = ""

    @property
    def cell(self) -> str:
        return f"{self.passed}/{self.total}"

    @property
    def complete(self) -> bool:
        return self.passed == self.total and not self.note


@dataclass
class StudentGrades:
    student: str
    exercises: dict[int, Graded] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)    # files that name no exercise
    network: str = "not started"
    seconds: float = 0.0

    def feedback(self) -> str:
        """The text a student gets: every exercise submitted, its failing cases, and what is missing."""
        done = sum(g.complete for g in self.exercises.values())
        lines = [f"{self.student}: {done} of {len(self.exercises)} submitted exercises pass "
                 f"({len(EXERCISES)} in the course)", ""]
        for number, g in sorted(self.exercises.items()):
            verdict = "passed" if g.complete else "FAILED"
            lines.append(f"exercise {number:02d} {EXERCISES[number].function} ({g.file}): {verdict} {g.cell} cases")
            lines += [f"    FAIL  {case}: {detail}" for case, detail in g.failures]
            if g.note:
                lines.append(f"    {g.note}")
        missing = [f"{n:02d}" for n in sorted(EXERCISES) if n not in self.exercises]
        if missing:
            lines += ["", f"not submitted: {', '.join(missing)}"]
        if self.ignored:
            lines.append(f"ignored (no such exercise): {', '.join(self.ignored)}")
        lines.append(f"graded in {self.seconds:.1f} s; network during grading: {self.network}")
        return "\n".join(lines) + "\n"


def find_submissions(root: str | Path) -> dict[str, dict[int, Path]]:
    """{student: {exercise: file}} in `root`: one subfolder per student (exNN_*.py anywhere inside it),
    or loose files named STUDENT_exNN_*.py (or STUDENT-exNN_...)."""
    root = Path(root)
    if not root.is_dir():
        raise MiniLLMError(f"{root} is not a folder of submissions (one subfolder per student)")
    found: dict[str, dict[int, Path]] = {}
    for path in sorted(root.iterdir()):
        if path.is_dir() and not path.name.startswith((".", "__")):
            files = sorted(p for p in path.rglob("ex[0-9][0-9]_*.py") if "__pycache__" not in p.parts)
            found[path.name] = {int(p.name[2:4]): p for p in reversed(files)}   # first in sorted order wins
        elif path.suffix == ".py":
            student, sep, rest = _split_loose(path.name)
            if sep:
                found.setdefault(student or root.name, {})[int(rest[2:4])] = path
    if not found:
        raise MiniLLMError(f"no submissions in {root}: expected one subfolder per student with exNN_*.py files")
    return found


def _split_loose(name: str) -> tuple[str, bool, str]:
    """'alice_ex01_rmsnorm.py' -> ('alice', True, 'ex01_rmsnorm.py'); a file naming no exercise -> ('', False, '')."""
    for i in range(len(name) - 4):
        if name[i:i + 2] == "ex" and name[i + 2:i + 4].isdigit() and name[i + 4:i + 5] == "_" \
                and (i == 0 or name[i - 1] in "_-."):
            return name[:max(i - 1, 0)], True, name[i:]
    return "", False, ""


def grade_folder(root: str | Path, csv_path: str | Path | None = None, feedback_dir: str | Path | None = None,
                 limits: Limits | None = None) -> list[StudentGrades]:
    """Grade every student in `root`; write the CSV (a row per student, a column per exercise: cases
    passed/total, empty if not submitted) and one feedback text per student."""
    limits = limits or Limits()
    submissions = find_submissions(root)
    totals = {n: len(ex.cases()) for n, ex in EXERCISES.items()}
    with ThreadPoolExecutor(max_workers=max(1, limits.jobs)) as pool:
        grades = list(pool.map(lambda item: grade_student(item[0], item[1], limits, totals), submissions.items()))
    if csv_path is not None:
        write_csv(grades, csv_path)
    if feedback_dir is not None:
        feedback_dir = Path(feedback_dir)
        feedback_dir.mkdir(parents=True, exist_ok=True)
        for g in grades:
            (feedback_dir / f"{g.student}.txt").write_text(g.feedback())
    return grades


def write_csv(grades: list[StudentGrades], path: str | Path) -> None:
    numbers = sorted(EXERCISES)
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["student"] + [f"ex{n:02d}" for n in numbers] + ["exercises passed"])
        for g in grades:
            cells = [g.exercises[n].cell if n in g.exercises else "" for n in numbers]
            out.writerow([g.student] + cells + [sum(x.complete for x in g.exercises.values())])


def grade_student(student: str, files: dict[int, Path], limits: Limits,
                  totals: dict[int, int] | None = None) -> StudentGrades:
    """Grade one student's files in sandboxed children: a child that dies or hangs costs the exercise
    it was on; a new child grades the rest."""
    totals = totals or {n: len(ex.cases()) for n, ex in EXERCISES.items()}
    grades = StudentGrades(student)
    start = time.monotonic()
    pending = []
    for number, path in sorted(files.items()):
        if number in EXERCISES:
            pending.append(number)
        else:
            grades.ignored.append(path.name)
    while pending:
        events, stopped = _run_child({n: files[n] for n in pending}, limits)
        current = None
        for ev in events:
            if "network" in ev:
                grades.network = ev["network"]
            elif "start" in ev:
                current = ev["start"]
            elif "done" in ev:
                grades.exercises[ev["done"]] = _graded(ev, files[ev["done"]], totals[ev["done"]])
                pending.remove(ev["done"])
                current = None
        if current is None:          # the child died between exercises, or before the first one
            if pending:
                for n in pending:
                    grades.exercises[n] = Graded(n, files[n].name, 0, totals[n], note=f"not graded: {stopped}")
            break
        grades.exercises[current] = Graded(current, files[current].name, 0, totals[current], note=stopped)
        pending.remove(current)
    grades.seconds = time.monotonic() - start
    return grades


def _graded(ev: dict, path: Path, total: int) -> Graded:
    failures = [(name, detail) for name, ok, detail in ev["cases"] if not ok]
    return Graded(ev["done"], path.name, sum(ok for _, ok, _ in ev["cases"]), total, failures, ev["note"])


def _run_child(files: dict[int, Path], limits: Limits) -> tuple[list[dict], str]:
    """Run sandbox.py on these files; its events, and why it stopped early ("" if it finished)."""
    read_fd, write_fd = os.pipe()
    cpu_s = int(limits.time_s * len(files) + STARTUP_S + 10)
    cmd = [sys.executable, str(SANDBOX), str(write_fd), str(limits.memory_mb << 20), str(cpu_s), str(limits.time_s)]
    cmd += [f"{n}={p.resolve()}" for n, p in sorted(files.items())]
    env = dict(os.environ, MINILLM_SANDBOX_ROOT=str(PACKAGE_ROOT), PYTHONDONTWRITEBYTECODE="1",
               OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    with tempfile.TemporaryDirectory(prefix="minillm-grade-") as cwd, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, pass_fds=(write_fd,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=err, cwd=cwd, env=env)
        os.close(write_fd)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_read_lines, args=(read_fd, lines), daemon=True).start()
        events, deadline, why = [], time.monotonic() + STARTUP_S + limits.time_s, ""
        while True:
            try:
                ev = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                proc.kill()
                why = f"stopped: over the time limit of {limits.time_s:g} s (the process was killed)"
                break
            if ev is None:
                break
            events.append(ev)
            if "start" in ev:
                deadline = time.monotonic() + limits.time_s + GRACE_S
        code = proc.wait()
        if not why and not (events and "done" in events[-1] and len([e for e in events if "done" in e]) == len(files)):
            err.seek(0)
            tail = err.read().decode(errors="replace").strip().splitlines()[-1:] or [""]
            why = f"the grading process died ({_exit_reason(code)}){': ' + tail[0] if tail[0] else ''}"
    return events, why


def _read_lines(fd: int, out: queue.Queue) -> None:
    with os.fdopen(fd) as f:
        for line in f:
            try:
                out.put(json.loads(line))
            except json.JSONDecodeError:
                pass                  # a torn last line of a killed child
    out.put(None)


def _exit_reason(code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name
        return f"{name}: {'over the CPU-time limit' if name == 'SIGXCPU' else 'killed' if name == 'SIGKILL' else 'crashed'}"
    return f"exit code {code}"


def format_grades(grades: list[StudentGrades], csv_path=None, feedback_dir=None) -> str:
    """`minillm exercise grade`: a line per student, then where the CSV and the feedback went."""
    width = max(len(g.student) for g in grades)
    lines = []
    for g in grades:
        done = sum(x.complete for x in g.exercises.values())
        failed = [f"{n:02d}" for n, x in sorted(g.exercises.items()) if not x.complete]
        lines.append(f"{g.student:<{width}}  {done}/{len(g.exercises)} submitted exercises pass"
                     f"{'  (failing: ' + ', '.join(failed) + ')' if failed else ''}  [{g.seconds:.1f} s]")
    networks = {g.network for g in grades}
    lines.append(f"network during grading: {'; '.join(sorted(networks))}")
    if csv_path is not None:
        lines.append(f"wrote {csv_path} ({len(grades)} students)")
    if feedback_dir is not None:
        lines.append(f"wrote feedback for each student into {feedback_dir}/")
    return "\n".join(lines)
