"""A wrong solution of exercise 28: it penalizes a token once per occurrence (a loop over token_ids)."""
import numpy as np

FAILS_CASE = "seen five times"
SAYS = "penalized once"


def repetition_penalty(logits, token_ids, penalty):
    out = logits.copy()
    for t in token_ids:
        out[t] = out[t] / penalty if out[t] > 0 else out[t] * penalty
    return out
