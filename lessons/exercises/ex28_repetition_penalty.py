"""Exercise 28 (lesson 28): the repetition penalty, one of the sampling controls.

Write `repetition_penalty` below, then check it:
    minillm exercise check 28         (in a clone: pytest lessons/exercises --exercise 28)
The grader compares it with `minillm.course.repetition_penalty_reference`, the engine's own step
(engine/sampling.py, `apply_repetition_penalty`), which HF transformers' RepetitionPenaltyLogitsProcessor
and vLLM apply the same way.
"""
import numpy as np


def repetition_penalty(logits: np.ndarray, token_ids: np.ndarray, penalty: float) -> np.ndarray:
    """Make every token already seen (in the prompt or the answer so far) less likely.

    logits     [vocab] float32   one position's next-token scores
    token_ids  [n] int           the prompt and the answer so far; a token may appear many times
    penalty    float > 0         1 changes nothing; above 1 penalizes, below 1 rewards repetition
    returns    [vocab]           a new array: for each DISTINCT seen token t,
                                     logits[t] / penalty   if logits[t] > 0
                                     logits[t] * penalty   otherwise (a negative logit goes further down)
                                 and every other token unchanged.

    A token seen five times is penalized once (the frequency penalty is the one that counts). A logit
    at -inf (a token a mask removed) stays -inf. Do not modify the inputs in place.
    """
    raise NotImplementedError("write repetition_penalty: see the docstring")


if __name__ == "__main__":   # `python lessons/exercises/ex28_repetition_penalty.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise(28, __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
