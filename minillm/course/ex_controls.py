"""Exercise 28, sampling controls: the repetition penalty (CTRL's, HF's and vLLM's), which makes every token
already in the prompt or the answer less likely, once per distinct token (lesson 28)."""
from __future__ import annotations

import numpy as np

from minillm.course.cases import Case, CaseFailed, case_rng, expect_close, expect_unchanged


def repetition_penalty_reference(logits: np.ndarray, token_ids: np.ndarray, penalty: float) -> np.ndarray:
    """engine/sampling.py's step 2 on one row: logits [vocab], token_ids [n] (repeats allowed) -> [vocab]."""
    from minillm.engine.sampling import apply_repetition_penalty
    return apply_repetition_penalty(logits, np.unique(np.asarray(token_ids, dtype=np.int64)), penalty)


def _penalty_cases() -> list[Case]:
    rng = case_rng(28)

    def case(name, vocab, n_seen, penalty, low=-4.0, high=4.0, repeats=False, masked=0):
        logits = rng.uniform(low, high, vocab).astype(np.float32)
        ids = rng.choice(vocab, size=n_seen, replace=repeats).astype(np.int64)
        if masked:                                    # tokens a mask already removed: -inf stays -inf
            logits[rng.choice(ids, size=min(masked, n_seen), replace=False)] = -np.inf
        return Case(name, dict(logits=logits, token_ids=ids, penalty=float(penalty)))
    return [case("positive logits only, penalty 1.3 (divide)", 50, 10, 1.3, low=0.5),
            case("negative logits only, penalty 1.3 (multiply: they must go further down)", 50, 10, 1.3, high=-0.5),
            case("mixed signs, penalty 1.5, 2,000 tokens", 2000, 200, 1.5),
            case("a token seen five times is penalized once", 40, 60, 1.4, repeats=True),
            case("penalty 0.8 < 1 rewards repetition instead", 100, 30, 0.8),
            case("no token seen yet: nothing changes", 30, 0, 2.0),
            case("a masked token (-inf) stays -inf", 60, 20, 1.2, masked=3)]


def _check_penalty(fn, case: Case) -> str:
    logits, ids, penalty = case.inputs["logits"], case.inputs["token_ids"], case.inputs["penalty"]
    given_logits, given_ids = logits.copy(), ids.copy()
    got = fn(given_logits, given_ids, penalty)
    expect_unchanged("logits", logits, given_logits)
    expect_unchanged("token_ids", ids, given_ids)
    want = repetition_penalty_reference(logits, ids, penalty)
    got = np.asarray(got) if isinstance(got, (list, tuple)) else got
    finite = np.isfinite(want)
    if isinstance(got, np.ndarray) and got.shape == want.shape:
        if not np.array_equal(np.isneginf(got), np.isneginf(want)):
            raise CaseFailed("a token at -inf (masked) must stay -inf, and no other token may become -inf")
        seen, count = np.unique(ids), np.zeros(len(logits), dtype=int)
        np.add.at(count, ids, 1)
        twice = np.flatnonzero((count > 1) & finite)
        per_occurrence = np.where(logits > 0, logits / penalty ** count, logits * penalty ** count)
        if len(twice) and np.allclose(got[twice], per_occurrence[twice], rtol=1e-4, atol=1e-5) \
                and not np.allclose(got[twice], want[twice], rtol=1e-4, atol=1e-5):
            raise CaseFailed(f"token {int(twice[0])} appears {int(count[twice[0]])} times: it is penalized once, "
                             "not once per occurrence (use the distinct ids)")
        negative = seen[(logits[seen] < 0) & finite[seen]]
        if len(negative) and not np.allclose(got[negative], want[negative], rtol=1e-4, atol=1e-5):
            raise CaseFailed(f"token {int(negative[0])} has a negative logit {float(logits[negative[0]]):.3f}: "
                             "multiply it by the penalty (dividing would make it MORE likely)")
        got = np.where(np.isneginf(got), 0.0, got)
    return expect_close("logits", got, np.where(finite, want, 0.0))
