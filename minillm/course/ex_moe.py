"""Exercise 22 (lesson 22), the mixture-of-experts router: softmax over the experts, the top k per
token, their weights renormalized to sum to 1 (Mixtral's router, moe.route)."""
from __future__ import annotations

import numpy as np

from minillm.course.cases import Case, CaseFailed, _expect_tuple, case_rng, expect_close, expect_unchanged


def top_k_route_reference(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The engine's router on given router logits.   logits [T, E] -> ids [T, k], weights [T, k]"""
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)                         # [T, E]
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]            # [T, k], best first
    weights = np.take_along_axis(probs, ids, axis=-1)
    return ids, (weights / weights.sum(axis=-1, keepdims=True)).astype(np.float32)


def _route_cases() -> list[Case]:
    rng = case_rng(22)

    def logits(T, E, scale=1.0, shift=0.0):
        return (rng.standard_normal((T, E)) * scale + shift).astype(np.float32)
    return [Case("8 experts, top-2, 5 tokens (Mixtral's shape)", dict(logits=logits(5, 8), k=2)),
            Case("64 experts, top-6, 7 tokens", dict(logits=logits(7, 64), k=6)),
            Case("top-1: the one weight is 1.0", dict(logits=logits(4, 8), k=1)),
            Case("logits near 800: exp overflows float32 unless you subtract the max", dict(logits=logits(3, 8, 3.0, 800.0), k=2)),
            Case("k = E: every expert, weights = the full softmax", dict(logits=logits(3, 4), k=4)),
            Case("one token", dict(logits=logits(1, 16, 2.0), k=4))]


def _check_route(fn, case: Case) -> str:
    logits, k = case.inputs["logits"], case.inputs["k"]
    given = logits.copy()
    ids, weights = _expect_tuple(fn(given, k), 2, "ids, weights")
    expect_unchanged("logits", logits, given)
    want_ids, want_w = top_k_route_reference(logits, k)
    if ids.shape != want_ids.shape:
        raise CaseFailed(f"ids has shape {list(ids.shape)}, expected {list(want_ids.shape)} (tokens x k)")
    if not np.issubdtype(ids.dtype, np.integer):
        raise CaseFailed(f"ids has dtype {ids.dtype}, expected integer expert indices")
    # Any order of the k experts is right, as long as each weight stays with its expert: sort both by id.
    order, want_order = np.argsort(ids, axis=-1), np.argsort(want_ids, axis=-1)
    got_ids, exp_ids = np.take_along_axis(ids, order, -1), np.take_along_axis(want_ids, want_order, -1)
    wrong = np.flatnonzero((got_ids != exp_ids).any(axis=-1))
    if wrong.size:
        t = int(wrong[0])
        raise CaseFailed(f"token {t}: chose experts {sorted(ids[t].tolist())}, the {k} most likely are "
                         f"{sorted(want_ids[t].tolist())}")
    got_w = np.take_along_axis(np.asarray(weights, np.float32), order, -1)
    sums = got_w.sum(axis=-1)
    if not np.allclose(sums, 1.0, atol=1e-5):
        raise CaseFailed(f"the k weights of token 0 sum to {sums[0]:.6g}: renormalize them to sum to 1 "
                         "(divide the chosen probabilities by their sum)")
    return expect_close("weights", got_w, np.take_along_axis(want_w, want_order, -1))
