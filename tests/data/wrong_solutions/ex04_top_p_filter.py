"""A deliberately wrong solution of exercise 04: it drops the token whose probability carries the mass past p.
The grader must fail it on the case named FAILS_CASE, with SAYS in its message (tests/test_exercises.py)."""
import numpy as np

FAILS_CASE = 'the token that crosses p'
SAYS = 'carries the mass past p'


def top_p_filter(logits, p):
    order = np.argsort(-logits)
    probs = np.exp(logits[order] - logits.max())
    probs /= probs.sum()
    out = np.full_like(logits, -np.inf)
    keep = order[np.cumsum(probs) <= p]
    out[keep] = logits[keep]
    return out
