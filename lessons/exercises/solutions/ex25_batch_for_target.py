"""Exercise 25 (lesson 25): the largest batch that meets a latency target.

Reference solution (for teachers; never in the handout). The stub is lessons/exercises/ex25_batch_for_target.py.

Write `batch_for_target` below, then check it:
    minillm exercise check 25         (in a clone: pytest lessons/exercises --exercise 25)
The grader compares it with `minillm.course.ex_deploy.batch_for_target_reference`, the colocated model of
minillm/tools/latency_plan.py (`minillm plan --latency-ms T --ttft-ms F`) applied to a table of step times.
"""
import numpy as np


def batch_for_target(step_ms: np.ndarray, prefill_ms: float, output_tokens: int, latency_ms: float,
                     ttft_ms: float) -> int:
    """The largest batch that meets both latency targets when prefill and decode share one worker.

    step_ms        [max_batch]  ms of one decode step at batch 1, 2, ..., max_batch (measured, so it
                                need not grow with the batch)
    prefill_ms     ms of one prompt's prefill, which holds up every running user's step
    output_tokens  tokens each user decodes before a new prompt takes its place
    returns        the largest batch B (an int, 1..max_batch) whose time per output token and whose time to
                   first token, as lesson 25 models them, are within latency_ms and ttft_ms; 0 if no B is.
    Do not modify step_ms.
    """
    step_ms = np.asarray(step_ms, dtype=np.float64)                       # [max_batch]
    batch = np.arange(1, len(step_ms) + 1)                                # [max_batch] B = 1, 2, ...
    per_token = step_ms + batch / output_tokens * prefill_ms              # B / N_out prefills stall each step
    first_token = step_ms + prefill_ms                                    # finish the running step, then prefill
    ok = (per_token <= latency_ms) & (first_token <= ttft_ms)
    return int(batch[ok].max()) if ok.any() else 0


if __name__ == "__main__":   # `python lessons/exercises/ex25_batch_for_target.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise(25, __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
