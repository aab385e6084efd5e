"""Behaviour and GPU exercises through the real grader: the student's policy runs in a confined process and
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


def test_speculative_loop_solution_matches_greedy_in_the_sandbox(tmp_path):
    graded = _grade("20.2", SOLUTIONS / "ex20.2_speculative_loop.py", tmp_path)
    assert graded.complete and graded.total == 10, graded          # 5 public + 5 hidden


def test_a_speculative_loop_that_keeps_rejected_drafts_in_the_cache_fails_in_one_line(tmp_path):
    graded = _grade("20.2", WRONG / "ex20.2_speculative_loop.py", tmp_path)
    reasons = dict(graded.failures)
    reason = reasons["a drafter always wrong: one token per pass, every draft rolled back"]
    assert "keeps 7 cache positions; the committed tokens need 4" in reason and "\n" not in reason
    assert "a perfect drafter: every draft accepted, plus the bonus token" not in reasons   # nothing to roll back


EMITS_THE_DRAFT = '''def speculative_decode_step(state):       # emits the rejected draft instead of the target's token
    draft, best = state["draft"], state["target_argmax"]
    n = 0
    while n < len(draft) and draft[n] == best[n]:
        n += 1
    return {"emit": list(draft[:n + 1]) if n < len(draft) else list(draft) + [best[n]],
            "cache_length": state["cache_length"] - (len(draft) - n)}
'''


def test_a_speculative_loop_that_emits_a_rejected_draft_is_not_greedy(tmp_path):
    (tmp_path / "ex20.2_speculative_loop.py").write_text(EMITS_THE_DRAFT)
    graded = grade_exercise("20.2", tmp_path / "ex20.2_speculative_loop.py", Limits(time_s=20), make_plan(seed=7),
                            tmp_path)
    reason = dict(graded.failures)["a drafter always wrong: one token per pass, every draft rolled back"]
    assert "greedy decoding gives" in reason


def test_the_gpu_kernel_exercise_is_never_passed_without_a_gpu(tmp_path):
    from minillm.course.gpu_parts import why_no_gpu
    from minillm.course.grading import StudentGrades
    graded = _grade("12.2", SOLUTIONS / "ex12.2_rmsnorm_kernel.py", tmp_path)
    if why_no_gpu() is None:                                        # on a GPU: the solution's kernel passes
        assert graded.complete and graded.total == 10, graded
        return
    assert not graded.complete and graded.passed == 0 and graded.score == 0
    assert graded.note.startswith("not graded (no GPU")
    feedback = StudentGrades("ann", {"12.2": graded}).feedback()
    assert "exercise 12.2 rmsnorm_kernel" in feedback and "FAILED" in feedback and "not graded (no GPU" in feedback
    from click.testing import CliRunner
    from minillm.cli import cli
    listed = CliRunner().invoke(cli, ["exercise", "list", "--folder", str(tmp_path)])
    row = next(line for line in listed.output.splitlines() if line.startswith("12.2"))
    assert "not graded (no GPU" in row and "passed" not in row, listed.output
    checked = CliRunner().invoke(cli, ["exercise", "check", "12.2", "--folder", str(tmp_path)])
    assert checked.exit_code != 0 and "NOT GRADED: no case ran" in checked.output, checked.output


def test_radix_tree_solution_reuses_tokens_on_a_branching_conversation_in_the_sandbox(tmp_path):
    graded = _grade("18.2", SOLUTIONS / "ex18.2_radix_insert.py", tmp_path)
    assert graded.complete and graded.total == 10, graded


def test_a_radix_tree_that_never_splits_an_edge_fails_in_one_line(tmp_path):
    graded = _grade("18.2", WRONG / "ex18.2_radix_insert.py", tmp_path)
    reason = dict(graded.failures)["a branching conversation: answers regenerated from the middle of an edge"]
    assert reason == "step 1: two edges below node -1 start with the same token: split the shared part"


WRONG_MATCH = '''def radix_insert(tree, tokens):      # counts matches in whole edges only (a partial edge counts 0)
    import copy
    tree = copy.deepcopy(tree)
    node, i = -1, 0
    while True:
        child = next((c for c, n in enumerate(tree)
                      if n["parent"] == node and tokens[i:i + len(n["tokens"])] == n["tokens"]), None)
        if child is None:
            break
        node, i = child, i + len(tree[child]["tokens"])
    tree.append({"parent": node, "tokens": tokens[i:]}) if i < len(tokens) else None
    return {"matched": i, "tree": tree}
'''


def test_a_radix_tree_matching_whole_edges_only_undercounts_and_fails(tmp_path):
    (tmp_path / "ex18.2_radix_insert.py").write_text(WRONG_MATCH)
    graded = grade_exercise("18.2", tmp_path / "ex18.2_radix_insert.py", Limits(time_s=20), make_plan(seed=7),
                            tmp_path)
    reason = dict(graded.failures)["a branching conversation: answers regenerated from the middle of an edge"]
    assert "step 1: matched 0 tokens, but an earlier request shares its first" in reason


def test_flashnorm_plan_solution_passes_in_the_sandbox(tmp_path):
    graded = _grade("15.2", SOLUTIONS / "ex15.2_deferred_plan.py", tmp_path)
    assert graded.complete and graded.total == 8, graded


PLANS = {
    "races": '''def deferred_plan(block):           # reads s on stream 0 with no wait
    ws = block["weights"]
    return ([{"op": "inv_rms", "in": "x", "out": "s", "stream": 1}]
            + [{"op": "matmul", "in": "x", "w": w, "out": w + "_raw", "stream": 0} for w in ws]
            + [{"op": "scale", "in": w + "_raw", "by": "s", "out": w, "stream": 0} for w in ws])
''',
    "serial": '''def deferred_plan(block):           # the norm first on the projections' stream: nothing overlaps
    ws = block["weights"]
    return ([{"op": "inv_rms", "in": "x", "out": "s", "stream": 0}]
            + [{"op": "scale", "in": "x", "by": "s", "out": "h", "stream": 0}]
            + [{"op": "matmul", "in": "h", "w": w, "out": w, "stream": 0} for w in ws if block["kind"] != "mlp"])
''',
}


def test_flashnorm_plans_that_race_or_do_not_overlap_fail_in_one_line(tmp_path):
    reasons = {}
    for name, source in PLANS.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "ex15.2_deferred_plan.py").write_text(source)
        graded = grade_exercise("15.2", folder / "ex15.2_deferred_plan.py", Limits(time_s=20), make_plan(seed=7),
                                folder)
        reasons[name] = dict(graded.failures)["attention's q, k and v"]
    assert reasons["races"] == "step 0: op 4 reads 's' on stream 0, made on stream 1, without a wait for it: a race"
    assert reasons["serial"].startswith("every projection waited for 1/RMS: nothing overlaps")
