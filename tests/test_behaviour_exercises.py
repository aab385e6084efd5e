"""Behaviour exercises through the real grader: the student's policy runs in a confined process and
answers with decisions as data; the grader replays them on its own engine objects (course/behaviour.py)."""
import shutil
from pathlib import Path

from minillm.course.grading import Limits, grade_exercise, make_plan

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = ROOT / "lessons" / "exercises" / "solutions"
WRONG = ROOT / "tests" / "data" / "wrong_solutions"

NEVER_PREEMPTS = '''def schedule_step(state):
    run, free, bs, budget = [], state["free_blocks"], state["block_size"], state["max_batch_tokens"]
    for seq in state["running"] + [dict(s, computed=0, blocks=0) for s in state["waiting"]]:
        n = min(seq["tokens"] - seq["computed"], budget)
        need = -(-(seq["computed"] + n) // bs) - seq["blocks"]
        if n and need <= free:                  # runs what fits; waits forever for blocks nobody frees
            run.append([seq["id"], n])
            free, budget = free - need, budget - n
    return {"preempt": [], "run": run}
'''


def _grade(number, path, tmp_path):
    shutil.copy(path, tmp_path / path.name)
    return grade_exercise(number, tmp_path / path.name, Limits(time_s=20), make_plan(seed=7), tmp_path)


def test_scheduler_solution_passes_public_and_hidden_cases_in_the_sandbox(tmp_path):
    graded = _grade("17.2", SOLUTIONS / "ex17.2_schedule_step.py", tmp_path)
    assert graded.complete and graded.total == 8, graded           # 4 public + 4 hidden


def test_a_scheduler_that_over_commits_fails_in_one_line(tmp_path):
    graded = _grade("17.2", WRONG / "ex17.2_schedule_step.py", tmp_path)
    assert not graded.complete and graded.passed < graded.total
    reasons = dict(graded.failures)
    reason = reasons["eight short requests at once in a tight pool"]
    assert "over-commits the pool" in reason and "\n" not in reason


def test_a_scheduler_that_never_preempts_stalls_and_fails(tmp_path):
    (tmp_path / "ex17.2_schedule_step.py").write_text(NEVER_PREEMPTS)
    graded = grade_exercise("17.2", tmp_path / "ex17.2_schedule_step.py", Limits(time_s=20), make_plan(seed=7),
                            tmp_path)
    reasons = dict(graded.failures)
    assert "makes no progress" in reasons["a pool too small for all at once: someone must be preempted"]
