"""Exercise 20 (lesson 20): the step of speculative sampling that keeps the target's distribution exact.

Write `speculative_step` below, then check it:
    minillm exercise check 20         (in a clone: pytest lessons/exercises --exercise 20)
The grader compares it with the engine's rule (`minillm.engine.speculative.acceptance`), and then
enumerates every draft token to check that the token a step emits is distributed exactly as p.
"""
import numpy as np


def speculative_step(p: np.ndarray, q: np.ndarray, token: int) -> tuple[float, np.ndarray]:
    """One drafted token, judged by the target.

    p      [V] the target's probabilities for the next token (already filtered: temperature, top-k, top-p)
    q      [V] the draft's probabilities, from which `token` was drawn (so q[token] > 0)
    token  the drafted token
    returns (a, r):
        a  the probability of accepting the token: min(1, p[token] / q[token])
        r  [V] what to draw from when it is rejected: max(0, p - q), normalized to sum to 1

    Why it is exact: the token is kept with probability q(x)·a(x) = min(p(x), q(x)); the rest of the
    time (probability 1 - Σ min(p, q)) a token is drawn from r, which adds exactly p(x) - min(p(x), q(x)).
    Do not change p or q in place. (r is only used when a < 1, so p == q never needs it.)
    """
    raise NotImplementedError("write speculative_step: see the docstring")


if __name__ == "__main__":   # `python lessons/exercises/ex20_speculative_step.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise(20, __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
