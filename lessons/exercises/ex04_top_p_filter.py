"""Exercise 04 (lesson 04): nucleus (top-p) filtering of the next-token logits.

Write `top_p_filter` below, then check it:
    minillm exercise check 4          (in a clone: pytest lessons/exercises --exercise 4)
The grader compares it with the engine's `minillm.engine.sampling.top_p_filter` on random inputs.
"""
import numpy as np


def top_p_filter(logits: np.ndarray, p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose probability adds up to at least p.

    logits:  [vocab]  unsorted scores (float32 or float64)
    p:       in (0, 1]; 1.0 keeps every token
    returns  [vocab]  a new array: kept tokens keep their logit, dropped ones become -inf

    Rank tokens by probability (softmax of the logits), most likely first, and keep them while the
    mass of the tokens ranked ABOVE a token is still < p. So the token whose probability carries the
    total past p is kept, and the most likely token always survives. Do not modify logits in place.
    """
    raise NotImplementedError("write top_p_filter: see the docstring")


if __name__ == "__main__":   # `python lessons/exercises/ex04_top_p_filter.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise(4, __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
