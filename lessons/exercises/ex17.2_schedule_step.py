"""Exercise 17.2 (lesson 17): one step of continuous batching's scheduler, with preemption.

A behaviour exercise: your function decides, the grader's engine objects do. Each step the grader shows
you the batch as data; you answer which sequences run how many tokens, and which to preempt; the grader
replays that on its own block pool and queues, and fails the case the moment the pool is over-committed,
a request is lost, or nothing moves. Lesson 17 explains the mechanism (chunked prefill, recompute).

Write `schedule_step` below, then check it:
    minillm exercise check 17.2       (in a clone: pytest lessons/exercises --exercise 17.2)
"""


def schedule_step(state: dict) -> dict:
    """Decide one step of the batch.

    state (plain data, read-only):
      block_size        positions per KV block
      free_blocks       blocks the pool can hand out now
      max_batch_tokens  the most tokens this step may compute, all sequences together
      running   [{"id", "tokens", "computed", "blocks"}, ...]  oldest first: tokens = prompt + outputs so
                far, computed = how many of them have KV in the pool, blocks = how many blocks it holds
      waiting   [{"id", "tokens"}, ...]  front first; a preempted sequence comes back here, and must then
                recompute all its tokens (its blocks were given back)
    returns {"preempt": [id, ...], "run": [[id, n_tokens], ...]}
      preempt   running sequences whose blocks go back to the pool now (applied before "run")
      run       each sequence to compute n tokens of, 1 <= n <= tokens - computed (a waiting one is
                admitted by running it); a sequence at computed + n positions needs ceil((computed + n) /
                block_size) blocks, taken from free_blocks

    The contract: never ask for more blocks than are free (after your preemptions), never more than
    max_batch_tokens tokens, and make progress: every request must finish. When a running sequence
    cannot get its next block, preempt the newest running one (the engine's rule).
    """
    raise NotImplementedError("write schedule_step: see the docstring")


if __name__ == "__main__":   # `python lessons/exercises/ex17.2_schedule_step.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise("17.2", __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
