"""Exercise 25 (lesson 25): the largest batch that meets a latency target.

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
    raise NotImplementedError("write batch_for_target: see the docstring")


if __name__ == "__main__":   # `python lessons/exercises/ex25_batch_for_target.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise(25, __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
