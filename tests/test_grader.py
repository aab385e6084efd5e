"""The teacher's tools: a folder of students graded each exercise in an isolated process (CSV, feedback,
Markdown/HTML reports, Gradescope's results.json), the handout (stubs only), and the exercise list with a
student's status. The attacks on the grade are tests/test_grading_attacks.py."""
import csv
import json
import shutil
import socket
import time
from pathlib import Path

import pytest

from minillm.course import EXERCISES, exercise_path
from minillm.course.classroom import exercise_list, is_stub, solution_path, write_handout
from minillm.course.grading import Limits, find_submissions, grade_folder, grade_student, make_plan
from minillm.errors import MiniLLMError

WRONG_DIR = Path(__file__).parent / "data" / "wrong_solutions"
LOOP = '''
def kv_cache_update(cache_k, cache_v, k_new, v_new, pos):
    while True:          # a student's infinite loop
        pass
'''


def _copy(number: int, folder: Path, source: Path | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(source or solution_path(number), folder / exercise_path(number).name)


def test_three_students_give_the_expected_csv_within_a_bounded_time(tmp_path):
    subs = tmp_path / "submissions"
    for n in (1, 2, 24):
        _copy(n, subs / "alice")                                       # all correct
    _copy(1, subs / "bob"), _copy(24, subs / "bob")
    _copy(2, subs / "bob", next(WRONG_DIR.glob("ex02_*.py")))          # one wrong
    _copy(1, subs / "carol"), _copy(24, subs / "carol")
    (subs / "carol" / exercise_path(2).name).write_text(LOOP)          # loops forever in exercise 02 only
    start = time.monotonic()
    plan = make_plan(seed=42)
    grade_folder(subs, tmp_path / "grades.csv", tmp_path / "feedback", Limits(time_s=3, jobs=3), plan)
    assert time.monotonic() - start < 40                               # the loop cost its time limit, once

    rows = list(csv.DictReader(open(tmp_path / "grades.csv")))
    assert [r["student"] for r in rows] == ["alice", "bob", "carol"]
    assert list(rows[0])[1:-3] == [f"ex{n}" for n in EXERCISES]         # a column per exercise
    assert list(rows[0])[-3:] == ["exercises passed", "points", "max points"]
    n1, n2, n24 = (len(plan.cases[n]) for n in ("01", "02", "24"))     # public + hidden cases
    assert n1 == 2 * len(EXERCISES[1].cases())
    got = {r["student"]: (r["ex01"], r["ex02"], r["ex24"], r["exercises passed"]) for r in rows}
    assert got["alice"] == (f"{n1}/{n1}", f"{n2}/{n2}", f"{n24}/{n24}", "3")
    assert got["bob"][0] == f"{n1}/{n1}" and got["bob"][2] == f"{n24}/{n24}" and got["bob"][3] == "2"
    assert got["bob"][1] != f"{n2}/{n2}"
    assert got["carol"] == (f"{n1}/{n1}", f"0/{n2}", f"{n24}/{n24}", "2")    # graded on after the loop
    assert all(r["ex03"] == "" for r in rows)                                  # not submitted: empty
    assert [r["points"] for r in rows][::2] == ["3", "2"] and rows[0]["max points"] == str(len(EXERCISES))

    bob = (tmp_path / "feedback" / "bob.txt").read_text()
    wrong = next(WRONG_DIR.glob("ex02_*.py")).read_text()
    assert "exercise 02 kv_cache_update" in bob and "FAIL  prefill" in bob and "in place" in bob, bob
    assert "FAILS_CASE = 'prefill'" in wrong
    carol = (tmp_path / "feedback" / "carol.txt").read_text()
    missing = next(line for line in carol.splitlines() if line.startswith("not submitted: "))
    assert "over the time limit of 3 s" in carol and "03" in missing.split(": ")[1].split(", "), carol
    assert "hidden cases drawn with --seed 42" in carol
    assert "FAILED" not in (tmp_path / "feedback" / "alice.txt").read_text()


def test_a_crash_or_a_syntax_error_costs_only_that_exercise(tmp_path):
    folder = tmp_path / "dave"
    (folder).mkdir()
    (folder / "ex01_rmsnorm.py").write_text("import os\n\ndef rmsnorm(x, weight, eps):\n    os._exit(3)\n")
    (folder / "ex02_kv_cache_update.py").write_text("def kv_cache_update(:\n")
    _copy(24, folder)
    grades = grade_student("dave", find_submissions(tmp_path)["dave"], Limits(time_s=5), make_plan(seed=1))
    assert "died (exit code 3)" in grades.exercises["01"].failures[0][1]
    assert "SyntaxError" in grades.exercises["02"].note and "line 1" in grades.exercises["02"].note
    assert grades.exercises["24"].complete                    # a fresh process graded the rest


def test_grading_has_no_network(tmp_path):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    folder = tmp_path / "eve"
    folder.mkdir()
    (folder / "ex01_rmsnorm.py").write_text(
        "import socket\nimport numpy as np\n\n"
        "def rmsnorm(x, weight, eps):\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=2).close()   # reachable: an error\n"
        "    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight\n")
    try:
        grades = grade_student("eve", {"01": folder / "ex01_rmsnorm.py"}, Limits(time_s=5), make_plan(seed=1))
    finally:
        server.close()
    assert "Landlock" in grades.isolation and "seccomp" in grades.isolation
    graded = grades.exercises["01"]
    assert graded.passed == 0 and "raised PermissionError" in graded.failures[0][1], graded   # no connection


def test_handout_holds_the_stubs_and_no_solution_code(tmp_path):
    written = write_handout(tmp_path / "handout")
    assert sorted(p.name for p in written) == sorted(exercise_path(n).name for n in EXERCISES)
    assert sorted(p.name for p in (tmp_path / "handout").iterdir()) == sorted(["README.md"] + [p.name for p in written])
    for number, ex in EXERCISES.items():
        handed = (tmp_path / "handout" / exercise_path(number).name).read_text()
        assert is_stub(tmp_path / "handout" / exercise_path(number).name, ex.function)
        solution = solution_path(number).read_text()
        body = [line for line in solution.splitlines() if line.strip() and line not in handed.splitlines()]
        assert body and not any(line in handed for line in body if len(line.strip()) > 12)


def test_handout_refuses_a_filled_in_stub(tmp_path, monkeypatch):
    from minillm.course import classroom
    monkeypatch.setattr(classroom, "exercise_path", lambda n: solution_path(n))
    with pytest.raises(MiniLLMError, match="not a stub any more"):
        write_handout(tmp_path / "handout")
    assert not (tmp_path / "handout").exists()


def test_exercise_list_shows_each_status(tmp_path):
    shutil.copy(exercise_path(1), tmp_path)                           # the stub
    _copy(2, tmp_path)                                                # a solution
    _copy(24, tmp_path, next(WRONG_DIR.glob("ex24_*.py")))            # a wrong one
    (tmp_path / exercise_path(3).name).write_text("def apply_rope(x, cos, sin:\n")
    status = {r.number: r.status for r in exercise_list(tmp_path)}
    n2, n24 = len(EXERCISES[2].cases()), len(EXERCISES[24].cases())
    assert status["01"] == "not written" and status["02"] == f"passed {n2}/{n2}" and status["04"] == "no file"
    assert status["24"].startswith("failing ") and status["24"].endswith(f"of {n24}")
    assert status["03"].startswith("does not load") and "SyntaxError" in status["03"] and "line 1" in status["03"]


def test_cli_grade_handout_and_list(tmp_path):
    from click.testing import CliRunner
    from minillm.cli import cli
    _copy(1, tmp_path / "subs" / "ann")
    result = CliRunner().invoke(cli, ["exercise", "grade", str(tmp_path / "subs"), "--csv", str(tmp_path / "g.csv"),
                                      "--feedback", str(tmp_path / "fb")])
    assert result.exit_code == 0, result.output
    assert "ann" in result.output and "wrote" in result.output and (tmp_path / "fb" / "ann.txt").exists()
    result = CliRunner().invoke(cli, ["exercise", "handout", str(tmp_path / "out")])
    assert result.exit_code == 0 and f"wrote {len(EXERCISES)} exercise stubs" in result.output, result.output
    result = CliRunner().invoke(cli, ["exercise", "list"])
    assert result.exit_code == 0 and "merge_softmax_partials" in result.output, result.output


# ---- a teacher's workflow: points, class statistics, Markdown/HTML reports, Gradescope ----------------------------

def test_reports_beside_the_csv_and_gradescope_results(tmp_path):
    from click.testing import CliRunner
    from minillm.cli import cli
    subs = tmp_path / "subs"
    _copy(1, subs / "alice"), _copy(24, subs / "alice"), _copy(2, subs / "alice")
    _copy(1, subs / "<i>bob"), _copy(24, subs / "<i>bob", next(WRONG_DIR.glob("ex24_*.py")))
    (tmp_path / "points.toml").write_text('"01" = 2\n"24" = 3\n')             # 02 does not count
    result = CliRunner().invoke(cli, ["exercise", "grade", str(subs), "--csv", str(tmp_path / "g.csv"), "--seed", "9",
                                      "--points", str(tmp_path / "points.toml"), "--gradescope", str(tmp_path / "gs"),
                                      "--feedback", str(tmp_path / "fb")])
    assert result.exit_code == 0, result.output
    alice = next(line for line in result.output.splitlines() if line.startswith("alice"))
    assert "  5/5 points" in alice and "--seed 9" in result.output, result.output
    plan = make_plan(seed=9)
    n1, n24 = len(plan.cases["01"]), len(plan.cases["24"])
    rows = {r["student"]: r for r in csv.DictReader(open(tmp_path / "g.csv"))}
    assert rows["alice"]["points"] == "5" and rows["alice"]["max points"] == "5"
    bob_passed = int(rows["<i>bob"]["ex24"].split("/")[0])
    assert 0 < bob_passed < n24 and rows["<i>bob"]["ex24"] == f"{bob_passed}/{n24}"
    bob_points = round(2 + 3 * bob_passed / n24, 2)
    assert rows["<i>bob"]["points"] == f"{bob_points:g}"

    md = (tmp_path / "g.md").read_text()
    assert "hidden cases drawn with --seed 9" in md and "Landlock" in md and "NOT ISOLATED" not in md
    assert "| student | 01 | 02 | 24 | points (of 5) |" in md
    assert f"| alice | 2 ({n1}/{n1}) | 0 (10/10) | 3 ({n24}/{n24}) | 5 |" in md, md
    stats = {line.split(" | ")[0]: line for line in md.splitlines() if line.startswith("| 24 |")}
    mean = round((3 + round(3 * bob_passed / n24, 2)) / 2, 2)
    assert stats and "| 2/2 | 1 |" in stats["| 24"] and f"| {mean:g} |" in stats["| 24"], stats
    hardest = stats["| 24"].split(" | ")[-1].removesuffix(" (1 student) |")        # the case failed most
    assert f"FAIL  {hardest}: " in (tmp_path / "fb" / "<i>bob.txt").read_text(), stats
    html = (tmp_path / "g.html").read_text()
    assert "<td>alice</td>" in html and "&lt;i&gt;bob" in html and "<i>bob" not in html

    gs = json.loads((tmp_path / "gs" / "<i>bob" / "results.json").read_text())
    assert gs["score"] == bob_points and [t["max_score"] for t in gs["tests"]] == [2, 3]
    assert gs["tests"][0] == dict(name="exercise 01: rmsnorm", score=2, max_score=2, status="passed",
                                  output=f"{n1}/{n1} cases passed")
    assert gs["tests"][1]["status"] == "failed" and "FAIL " in gs["tests"][1]["output"]
    assert json.loads((tmp_path / "gs" / "alice" / "results.json").read_text())["score"] == 5


def test_one_students_folder_is_graded_as_gradescope_hands_it_over(tmp_path):
    from click.testing import CliRunner
    from minillm.cli import cli
    _copy(1, tmp_path / "submission")
    result = CliRunner().invoke(cli, ["exercise", "grade", str(tmp_path / "submission"), "--gradescope",
                                      str(tmp_path / "results"), "--feedback", str(tmp_path / "fb")])
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "results" / "results.json").read_text())
    assert results["score"] == 1 and len(results["tests"]) == len(EXERCISES)
    assert sum(t["status"] == "passed" for t in results["tests"]) == 1


def test_a_points_file_naming_no_exercise_is_one_line(tmp_path):
    from click.testing import CliRunner
    from minillm.cli import cli
    _copy(1, tmp_path / "subs" / "ann")
    (tmp_path / "points.toml").write_text('"99" = 2\n')
    result = CliRunner().invoke(cli, ["exercise", "grade", str(tmp_path / "subs"), "--points",
                                      str(tmp_path / "points.toml")])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1 and "points for no such exercise: 99" in lines[0], result.output


# ---- hidden cases and ids like 17.2 ----------------------------------------------------------------------------

def test_hidden_cases_are_fresh_reproducible_and_catch_a_lookup_table():
    import numpy as np
    from minillm.course import check_exercise
    from minillm.course.cases import hidden_cases
    from minillm.model.layers import rmsnorm
    ex = EXERCISES[1]
    a, b, c = hidden_cases(ex, 5), hidden_cases(ex, 5), hidden_cases(ex, 6)
    assert len(a) == len(ex.cases()) and all(h.name.startswith("hidden: ") for h in a)
    assert all(np.array_equal(x.inputs["x"], y.inputs["x"]) for x, y in zip(a, b))             # reproducible
    assert not any(np.array_equal(x.inputs["x"], y.inputs["x"]) for x, y in zip(a, c))         # fresh per seed
    assert not any(np.array_equal(x.inputs["x"], p.inputs["x"]) for x, p in zip(a, ex.cases()))
    recalled = {p.inputs["x"].tobytes(): rmsnorm(**p.inputs) for p in ex.cases()}              # public answers only
    report = check_exercise(1, lambda x, weight, eps: recalled[x.tobytes()], seed=5)
    public, hidden = report.cases[:len(ex.cases())], report.cases[len(ex.cases()):]
    assert all(r.passed for r in public) and hidden and not any(r.passed for r in hidden)
    assert "hidden cases drawn with --seed 5" in str(report)


def test_check_with_a_seed_runs_the_hidden_cases_too(tmp_path):
    from click.testing import CliRunner
    from minillm.cli import cli
    _copy(1, tmp_path)
    n1 = len(EXERCISES[1].cases())
    result = CliRunner().invoke(cli, ["exercise", "check", "1", "--folder", str(tmp_path), "--seed", "3"])
    assert result.exit_code == 0 and f"passed: {2 * n1}/{2 * n1} cases" in result.output, result.output
    assert "PASS  hidden: " in result.output and "hidden cases drawn with --seed 3" in result.output


def test_a_lessons_second_exercise_is_checked_listed_and_graded(tmp_path, monkeypatch):
    import numpy as np
    from click.testing import CliRunner
    from minillm.cli import cli
    from minillm.course.cases import Case, Exercise, expect_close
    from minillm.course.grading import grade_exercise
    second = Exercise(17, "double", 17, lambda x: 2 * x, lambda: [Case("three values", dict(x=np.arange(3.0)))],
                      lambda fn, case: expect_close("output", fn(case.inputs["x"]), 2 * case.inputs["x"]), part=2)
    monkeypatch.setitem(EXERCISES, "17.2", second)
    assert EXERCISES["17.2"] is second and EXERCISES[17] is EXERCISES["17"] is not second
    (tmp_path / "ex17.2_double.py").write_text("def double(x):\n    return x + x\n")
    shutil.copy(exercise_path(17), tmp_path)
    checked = CliRunner().invoke(cli, ["exercise", "check", "17.2", "--folder", str(tmp_path)])
    assert checked.exit_code == 0 and "exercise 17.2: double (" in checked.output, checked.output
    listed = CliRunner().invoke(cli, ["exercise", "list", "--folder", str(tmp_path)])
    line = next(line for line in listed.output.splitlines() if line.startswith("17.2"))
    assert "lesson 17" in line and "passed 1/1" in line and "ex17.2_double.py" in line, listed.output
    assert "not written" in next(line for line in listed.output.splitlines() if line.startswith("17 "))
    files = find_submissions(tmp_path)[tmp_path.name]
    assert files["17.2"].name == "ex17.2_double.py" and files["17"].name == exercise_path(17).name
    graded = grade_exercise("17.2", files["17.2"], Limits(time_s=5), make_plan(seed=1), tmp_path)
    assert graded.complete and graded.cell == "1/1", graded


# ---- a student's loop in a handed-out folder: handout, write, check, list -----------------------------------------

def _handout(tmp_path) -> Path:
    from click.testing import CliRunner
    from minillm.cli import cli
    folder = tmp_path / "my-exercises"
    result = CliRunner().invoke(cli, ["exercise", "handout", str(folder)])
    assert result.exit_code == 0, result.output
    return folder


def test_check_in_a_handout_folder_grades_the_students_file(tmp_path, monkeypatch):
    from click.testing import CliRunner
    from minillm.cli import cli
    folder = _handout(tmp_path)
    _copy(1, folder)                                                   # a correct rmsnorm
    wrong = next(WRONG_DIR.glob("ex02_*.py"))
    _copy(2, folder, wrong)                                            # a kv_cache_update that is not in place
    monkeypatch.chdir(folder)
    passed = CliRunner().invoke(cli, ["exercise", "check", "1"])
    assert passed.exit_code == 0, passed.output
    n1 = len(EXERCISES[1].cases())
    assert "(ex01_rmsnorm.py)" in passed.output and f"passed: {n1}/{n1} cases" in passed.output
    failed = CliRunner().invoke(cli, ["exercise", "check", "2"])
    assert failed.exit_code == 1 and "FAIL  prefill" in failed.output and "not written" not in failed.output, \
        failed.output
    stub = CliRunner().invoke(cli, ["exercise", "check", "3"])         # untouched: it says which file to open
    assert stub.exit_code == 1 and "open ex03_apply_rope.py" in stub.output, stub.output


def test_list_with_a_folder_shows_what_the_folder_holds(tmp_path):
    from click.testing import CliRunner
    from minillm.cli import cli
    folder = _handout(tmp_path)
    _copy(1, folder)
    (folder / exercise_path(4).name).unlink()                          # a student who removed one
    result = CliRunner().invoke(cli, ["exercise", "list", "--folder", str(folder)])
    assert result.exit_code == 0, result.output
    lines = {line[:2]: line for line in result.output.splitlines()}
    n1 = len(EXERCISES[1].cases())
    assert "my-exercises" in result.output.splitlines()[0]
    assert f"passed {n1}/{n1}" in lines["01"] and "not written" in lines["02"] and "no file" in lines["04"]
    assert result.output.rstrip().endswith(f"1 of {len(EXERCISES)} exercises pass")


def test_handout_readme_says_how_to_check_and_submit(tmp_path):
    readme = (_handout(tmp_path) / "README.md").read_text()
    for command in ("minillm exercise check 1", "minillm exercise list", "--folder", "minillm exercise grade"):
        assert command in readme, command
    assert "## Submit" in readme and "names unchanged" in readme
    assert all(f"`{exercise_path(n).name}`" in readme for n in EXERCISES)


def test_an_installed_wheel_points_at_handout_not_at_its_own_files(tmp_path, monkeypatch):
    """From a wheel, the shipped stubs sit inside site-packages: check and list outside a handout folder
    say how to make one, in one line, instead of grading (and naming) the package's own copy."""
    from click.testing import CliRunner
    from minillm.cli import cli
    from minillm import resources
    from minillm.course import grader
    monkeypatch.setattr(resources, "CHECKOUT_DIR", tmp_path / "not-a-checkout")    # as installed from a wheel
    assert not resources.is_checkout()
    monkeypatch.chdir(tmp_path)
    for command in (["exercise", "check", "1"], ["exercise", "list"]):
        result = CliRunner().invoke(cli, command)
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert result.exit_code == 1 and len(lines) == 1 and lines[0].startswith("minillm: error:"), result.output
        assert "minillm exercise handout DIR" in lines[0] and str(grader.EXERCISES_DIR) not in lines[0]
