"""Exercise 22 (lesson 22): the mixture-of-experts router, softmax top-k with renormalized weights.

Write `top_k_route` below, then check it:
    minillm exercise check 22         (in a clone: pytest lessons/exercises --exercise 22)
The grader compares it with the engine's router for Mixtral (`minillm.model.moe.route` with
router="softmax"), given the router's logits (h @ W_routerᵀ) instead of h and the router matrix.
"""
import numpy as np


def top_k_route(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Pick each token's k experts and the weight of each.

    1. Softmax over the experts (the last axis): subtract each row's max before np.exp, so logits
       near 800 do not overflow float32.
    2. The k largest probabilities of each row (np.argsort or np.argpartition): their expert ids.
    3. Their probabilities, renormalized to sum to 1 per token (divide by their sum): the weights
       the experts' outputs are summed with.

    logits   float32 [T, E]: token t's score for expert e; do not modify it
    returns  (ids int [T, k], weights float32 [T, k]); the k of a row in any order, each weight
             next to its expert's id
    """
    raise NotImplementedError("write top_k_route: see the docstring")


if __name__ == "__main__":   # `python lessons/exercises/ex22_top_k_route.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise(22, __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
