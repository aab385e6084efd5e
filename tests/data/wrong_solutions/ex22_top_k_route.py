"""A deliberately wrong solution of exercise 22: it picks the right experts but forgets to renormalize
their weights. The grader must fail it on the case named FAILS_CASE, with SAYS in its message."""
import numpy as np

FAILS_CASE = "8 experts, top-2"
SAYS = "renormalize"


def top_k_route(logits, k):
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1)[:, :k]
    return ids, np.take_along_axis(probs, ids, axis=-1).astype(np.float32)
