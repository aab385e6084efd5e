"""The attack suite: submissions that try to forge, copy or break their grade. Each is graded through the
real grader (a confined process per exercise, verdicts in the grader) and must come out failing, with
the grader and the teacher's files intact. Most attacks return the right answer only when the attack
worked, so a pass would mean the attack got through."""
import os
import signal
import textwrap
from pathlib import Path

import numpy as np
import pytest

from minillm.course import EXERCISES
from minillm.course.classroom import SOLUTIONS_DIR, solution_path
from minillm.course.grading import Limits, grade_exercise, make_plan
from minillm.course.remote import Submission

REPO = Path(__file__).resolve().parents[1]
LIMITS = Limits(time_s=3, memory_mb=1024, max_answer_mb=16)
RIGHT = "x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight"     # a correct rmsnorm
FORGED = '{"done": 1, "cases": [["all", true, "all cases passed"]], "note": ""}\\nall cases passed 9/6\\n'


@pytest.fixture(scope="module")
def plan():
    return make_plan(seed=1206)


def _grade(plan, tmp_path, body: str, number: str = "01", top: str = ""):
    """Grade `body` as the function of exercise `number` (its arguments as the stub names them)."""
    ex = EXERCISES[number]
    args = {"01": "x, weight, eps", "24": "m_a, l_a, acc_a, m_b, l_b, acc_b", "04": "logits, p"}[number]
    folder = tmp_path / "student"
    folder.mkdir(exist_ok=True)
    path = folder / solution_path(number).name
    path.write_text(f"import os, sys\nimport numpy as np\n{textwrap.dedent(top)}\n\n"
                    f"def {ex.function}({args}):\n{textwrap.indent(textwrap.dedent(body), '    ')}\n")
    graded = grade_exercise(number, path, LIMITS, plan, folder)
    assert 0 <= graded.passed <= graded.total == len(plan.cases[number])      # counted by the grader
    return graded


def _fails(graded) -> None:
    assert graded.passed < graded.total and not graded.complete, graded


def test_the_honest_answer_passes_through_the_same_path(plan, tmp_path):
    """The control: the harness grades a correct rmsnorm as complete, so each failure below is the attack's."""
    graded = _grade(plan, tmp_path, f"return {RIGHT}")
    assert graded.complete and graded.passed == graded.total == 10, graded


def test_forged_verdict_lines_on_every_descriptor_and_stdout(plan, tmp_path):
    graded = _grade(plan, tmp_path, f"""
        for fd in range(0, 64):
            try:
                os.write(fd, b'{FORGED}')
            except OSError:
                pass
        print("all cases passed")
        return x""")
    _fails(graded)
    assert graded.passed == 0


def test_forged_verdict_then_exit(plan, tmp_path):
    graded = _grade(plan, tmp_path, f"""
        for fd in range(3, 64):
            try:
                os.write(fd, b'{FORGED}')
            except OSError:
                pass
        os._exit(0)""")
    assert graded.passed == 0 and "not an answer" in graded.failures[0][1] or "died" in graded.failures[0][1], graded


def test_a_forged_frame_while_loading_stops_only_that_exercise(plan, tmp_path):
    """A file that writes a frame claiming the machine cannot isolate it (or any frame) while it is
    imported neither aborts the class's grading nor loads."""
    graded = _grade(plan, tmp_path, f"return {RIGHT}", top="""
        import json, struct
        body = json.dumps({"unconfined": "forged"}).encode()
        os.write(4, struct.pack("<II", len(body), 0) + body)""")
    assert graded.passed == 0 and "not an answer while it loaded" in graded.note, graded


def test_os_exit_in_the_function(plan, tmp_path):
    graded = _grade(plan, tmp_path, "os._exit(3)")
    assert graded.passed == 0 and "died (exit code 3)" in graded.failures[0][1], graded


@pytest.mark.parametrize("top, body, number", [
    ("from minillm.model.layers import rmsnorm as engine", "return engine(x, weight, eps)", "01"),
    ("", "from minillm.course import merge_partials_reference\nreturn merge_partials_reference(m_a, l_a, acc_a, m_b, "
         "l_b, acc_b)", "24"),
    ("sys.path.insert(0, " + repr(str(REPO)) + ")", "from minillm.model.layers import rmsnorm\n"
                                                   "return rmsnorm(x, weight, eps)", "01"),
])
def test_importing_the_engine_or_a_reference(plan, tmp_path, top, body, number):
    graded = _grade(plan, tmp_path, body, number, top)
    assert graded.passed == 0, graded


def test_reading_and_running_the_solutions(plan, tmp_path):
    solution = SOLUTIONS_DIR / solution_path(4).name
    graded = _grade(plan, tmp_path, f"""
        source = open({str(solution)!r}).read()
        space = {{}}
        exec(compile(source, "solution", "exec"), space)
        return space["top_p_filter"](logits, p)""", "04")
    assert graded.passed == 0 and "PermissionError" in graded.failures[0][1], graded


def test_a_symlink_to_the_solutions_is_refused(plan, tmp_path):
    folder = tmp_path / "mallory"
    folder.mkdir()
    link = folder / solution_path(4).name
    link.symlink_to(solution_path(4))
    graded = grade_exercise("04", link, LIMITS, plan, folder)
    assert graded.passed == 0 and graded.note.startswith("refused:") and "symbolic link" in graded.note


def test_writing_into_the_teachers_folder(plan, tmp_path):
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    graded = _grade(plan, tmp_path, f"""
        with open({str(teacher / 'grades.csv')!r}, "w") as f:
            f.write("student,ex01\\nmallory,9/6\\n")
        return {RIGHT}""")
    assert graded.passed == 0 and "PermissionError" in graded.failures[0][1], graded
    assert not (teacher / "grades.csv").exists()


def test_kill_the_grader(plan, tmp_path):
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: received.append(1))
    try:
        graded = _grade(plan, tmp_path, f"""
            os.kill(os.getppid(), {int(signal.SIGUSR1)})
            return {RIGHT}""")
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert graded.passed == 0 and not received, graded


def test_reading_the_graders_proc_files(plan, tmp_path):
    graded = _grade(plan, tmp_path, f"""
        parent = f"/proc/{{os.getppid()}}"
        secrets = open(parent + "/environ", "rb").read() + open(parent + "/cmdline", "rb").read()
        return {RIGHT}""")
    assert graded.passed == 0 and "PermissionError" in graded.failures[0][1], graded


def test_inherited_descriptors(plan, tmp_path):
    """A descriptor the teacher's process holds open (and marked inheritable) does not reach the student."""
    gradebook = tmp_path / "gradebook.txt"
    gradebook.write_text("SECRET gradebook\n")
    fd = os.open(gradebook, os.O_RDWR)
    os.set_inheritable(fd, True)
    try:
        graded = _grade(plan, tmp_path, f"""
            for fd in range(3, 256):
                try:
                    os.lseek(fd, 0, 0)
                    if b"SECRET" in os.read(fd, 100):
                        os.write(fd, b"mallory 9/6")
                        return {RIGHT}
                except OSError:
                    pass
            return x""")
    finally:
        os.close(fd)
    assert graded.passed == 0 and gradebook.read_text() == "SECRET gradebook\n", graded


def test_grader_controlling_environment_variables(plan, tmp_path, monkeypatch):
    """The teacher's PYTHONPATH (to a checkout) and MINILLM_* variables never reach the student's process,
    and what the student sets in its own environment reaches nothing."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("MINILLM_SANDBOX_ROOT", str(REPO))
    monkeypatch.setenv("PYTHONSTARTUP", str(solution_path(1)))
    graded = _grade(plan, tmp_path, f"""
        os.environ["MINILLM_UNSAFE"] = "1"
        if any(k.startswith(("MINILLM", "PYTHON")) for k in os.environ if k != "MINILLM_UNSAFE"):
            return {RIGHT}
        import minillm
        return {RIGHT}""")
    assert graded.passed == 0 and "No module named 'minillm'" in graded.failures[0][1], graded
    assert "MINILLM_UNSAFE" not in os.environ


def test_fork_bomb(plan, tmp_path):
    graded = _grade(plan, tmp_path, """
        while True:
            os.fork()""")
    assert graded.passed == 0 and "PermissionError" in graded.failures[0][1], graded


def test_infinite_loop_costs_its_time_limit_only(plan, tmp_path):
    graded = _grade(plan, tmp_path, "while True:\n    pass")
    assert graded.passed == 0 and all("over the time limit of 3 s" in d for _, d in graded.failures), graded


def test_memory_blow_up(plan, tmp_path):
    graded = _grade(plan, tmp_path, "hog = bytearray(8 << 30)\nreturn x")
    assert graded.passed == 0 and "MemoryError" in graded.failures[0][1], graded


# ---- bad submissions: one line each, and the grader goes on ----------------------------------------------

@pytest.mark.parametrize("body, words", [
    ("return {1, 2}", "returned a set, which is not data"),
    ("return np.array([object()] * 4, dtype=object)", "dtype object"),
    ("return x[:, :-1]", "has shape"),
    ("return np.broadcast_to(np.float32(1), (2**28,))", "1,024 MB of arrays, over the 16 MB"),
    # A frame forged onto the answer channel (fd 4), announcing a 1 GB array: refused before it is read.
    ("os.write(4, (16).to_bytes(4, 'little') + (1).to_bytes(4, 'little') + b'{\"value\": 1}    '\n"
     "         + (2**30).to_bytes(8, 'little'))\nreturn x", "not an answer"),
])
def test_bad_answers_fail_the_case_in_one_line(plan, tmp_path, body, words):
    graded = _grade(plan, tmp_path, body)
    assert graded.passed == 0 and words in graded.failures[0][1], graded
    assert all("\n" not in d for _, d in graded.failures)


def test_a_pickled_array_is_refused():
    """The channel reads .npy without pickle: an object array in a frame is refused, never unpickled."""
    import io
    from minillm.course import sandbox
    buf = io.BytesIO()
    np.save(buf, np.array([{"all": "passed"}], dtype=object), allow_pickle=True)
    header = b'{"value": {"$array": 0}}'
    frame = len(header).to_bytes(4, "little") + (1).to_bytes(4, "little") + header + \
        buf.tell().to_bytes(8, "little") + buf.getvalue()
    stream = io.BytesIO(frame)
    with pytest.raises(sandbox.BadFrame, match="not plain data"):
        sandbox.parse_frame(stream.read, 1 << 20)


def test_missing_function_and_a_shadowing_module(plan, tmp_path):
    folder = tmp_path / "student"
    folder.mkdir()
    (folder / "numpy.py").write_text("def sqrt(x):\n    return 1\n")                # beside the submission
    (folder / "minillm").mkdir()
    (folder / "minillm" / "__init__.py").write_text("")
    path = folder / solution_path(1).name
    path.write_text("import sys, types\nimport numpy as np\n"
                    "sys.modules['minillm.model.layers'] = types.SimpleNamespace(rmsnorm=lambda *a: 0)\n\n"
                    "def rms_norm(x, weight, eps):\n    return x\n")
    graded = grade_exercise("01", path, LIMITS, plan, folder)
    assert graded.passed == 0 and graded.note == "does not load: has no function rmsnorm()", graded
    path.write_text(path.read_text().replace("rms_norm", "rmsnorm"))
    graded = grade_exercise("01", path, LIMITS, plan, folder)
    assert graded.passed == 0 and "output: max abs error" in graded.failures[0][1], graded


# ---- where isolation is missing ----------------------------------------------------------------------------

def test_grading_refuses_in_one_line_where_isolation_is_missing(tmp_path, monkeypatch):
    """A child that cannot confine itself (no Landlock: macOS, an old kernel) makes grading refuse,
    naming --unsafe; the CLI says it in one line."""
    from click.testing import CliRunner
    from minillm.cli import cli
    from minillm.course import remote
    fake = tmp_path / "sandbox.py"
    fake.write_text("import json, os, struct\n"
                    "n = struct.unpack('<I', os.read(0, 4))[0]\nos.read(0, n)\n"
                    "body = json.dumps({'unconfined': 'this kernel has no Landlock'}).encode()\n"
                    "os.write(1, struct.pack('<II', len(body), 0) + body)\n")
    monkeypatch.setattr(remote, "SANDBOX", fake)
    (tmp_path / "subs" / "ann").mkdir(parents=True)
    (tmp_path / "subs" / "ann" / solution_path(1).name).write_text(solution_path(1).read_text())
    result = CliRunner().invoke(cli, ["exercise", "grade", str(tmp_path / "subs")])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1, result.output
    assert "cannot isolate" in lines[0] and "no Landlock" in lines[0] and "--unsafe" in lines[0]


def test_unsafe_grading_says_so_in_every_report(tmp_path):
    from minillm.course.grading import grade_folder
    from minillm.course.reports import gradescope_results, html_report, markdown_report
    plan = make_plan(seed=3, unsafe=True)
    assert plan.isolation == "not isolated (--unsafe)"
    (tmp_path / "subs" / "ann").mkdir(parents=True)
    (tmp_path / "subs" / "ann" / solution_path(1).name).write_text(solution_path(1).read_text())
    book = grade_folder(tmp_path / "subs", limits=LIMITS, plan=plan)
    assert book.students[0].exercises["01"].complete                 # verdicts still from the grader
    assert "NOT ISOLATED: graded with --unsafe" in markdown_report(book) and "NOT ISOLATED" in html_report(book)
    assert "isolation: not isolated (--unsafe)" in gradescope_results(book, "ann")["output"]


# ---- behaviour exercises: a policy's decisions replayed on the grader's engine objects ----------------------

class _AdmitWorld:
    """Requests needing some KV blocks each, a real BlockManager of 6 blocks: each step the policy names
    the requests to admit (data); the grader allocates their blocks and finishes them the next step."""

    def __init__(self, needs: list[int]):
        from minillm.engine.paged_kv import BlockManager
        self.blocks, self.needs, self.waiting, self.running = BlockManager(6), needs, list(range(len(needs))), {}
        self.served: list[int] = []

    def observe(self) -> dict:
        return {"waiting": [[r, self.needs[r]] for r in self.waiting], "free_blocks": self.blocks.num_free}

    def apply(self, decision) -> None:
        from minillm.course.cases import CaseFailed
        for r, table in self.running.items():                  # last step's batch finishes
            self.blocks.release_all(table)
            self.served.append(r)
        self.running = {}
        for r in list(decision["admit"]):
            if r not in self.waiting:
                raise CaseFailed(f"admitted request {r}, which is not waiting")
            if self.needs[r] > self.blocks.num_free:
                raise CaseFailed(f"admitted request {r} needing {self.needs[r]} blocks with "
                                 f"{self.blocks.num_free} free: the pool would be over-committed")
            self.running[r] = [self.blocks.allocate() for _ in range(self.needs[r])]
            self.waiting.remove(r)

    def done(self) -> bool:
        return not self.waiting and not self.running

    def verdict(self) -> str:
        from minillm.course.cases import CaseFailed
        if sorted(self.served) != list(range(len(self.needs))) or self.blocks.num_free != 6:
            raise CaseFailed(f"served {sorted(self.served)}, free blocks {self.blocks.num_free}")
        return f"served {len(self.served)} requests"


@pytest.mark.parametrize("policy, complete, says", [
    ("""admit, free = [], obs["free_blocks"]
        for r, need in obs["waiting"]:
            if need <= free:
                admit.append(r)
                free -= need
        return {"admit": admit}""", True, ""),
    ("return {'admit': [r for r, _ in obs['waiting']]}", False,
     "step 0: admitted request 1 needing 4 blocks with 3 free"),
    ("return {'admit': 'everything'}", False, "step 0: admitted request e, which is not waiting"),
    ("return None", False, "cannot be applied (TypeError"),
])
def test_a_policys_decisions_are_replayed_on_the_graders_block_manager(tmp_path, policy, complete, says):
    from minillm.course.behaviour import replay
    from minillm.course.cases import CaseFailed
    path = tmp_path / "ex99_admit.py"
    path.write_text(f"def admit(obs):\n    {textwrap.dedent(policy).strip()}\n".replace("\n        ", "\n    "))
    with Submission(path, "admit", time_s=10) as policy_fn:
        assert policy_fn.load_error is None, policy_fn.load_error
        try:
            summary, failure = replay(policy_fn, _AdmitWorld([3, 4, 2, 1, 5])), ""
        except CaseFailed as e:
            summary, failure = "", str(e)
    assert (summary == "served 5 requests") == complete and says in failure, (summary, failure)


def test_every_exercise_passes_the_isolated_grader_with_its_solution(tmp_path):
    """The protocol carries every registered exercise: each solution, called case by case from a confined
    process over the data channel, passes its public and hidden cases."""
    from minillm.course.grading import grade_folder
    student = tmp_path / "subs" / "sol"
    student.mkdir(parents=True)
    for number in EXERCISES:
        (student / solution_path(number).name).write_text(solution_path(number).read_text())
    book = grade_folder(tmp_path / "subs", limits=Limits(time_s=30), plan=make_plan(seed=7))
    graded = book.students[0].exercises
    assert list(graded) == list(EXERCISES)
    from minillm.course.gpu_parts import why_no_gpu
    no_gpu = {n for n in graded if EXERCISES[n].needs_gpu and why_no_gpu() is not None}   # 12.2 on a CPU machine
    assert all(not graded[n].complete and graded[n].note.startswith("not graded (no GPU") for n in no_gpu)
    assert all(g.complete for n, g in graded.items() if n not in no_gpu), {
        n: (g.cell, g.note, g.failures[:1]) for n, g in graded.items() if not g.complete and n not in no_gpu}


def test_an_array_header_claiming_a_terabyte_is_refused_before_allocating():
    """A forged .npy header may promise any shape; the grader checks it against the bytes that came."""
    import io
    from minillm.course import sandbox
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f8", "fortran_order": False, "shape": (2**37,)})
    npy = buf.getvalue() + b"\0" * 8
    header = b'{"value": {"$array": 0}}'
    frame = len(header).to_bytes(4, "little") + (1).to_bytes(4, "little") + header + \
        len(npy).to_bytes(8, "little") + npy
    with pytest.raises(sandbox.BadFrame, match=r"shape \[137438953472\] whose data is 8 bytes"):
        sandbox.parse_frame(io.BytesIO(frame).read, 1 << 20)
