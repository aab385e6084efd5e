"""Exercise 20, speculative sampling: the acceptance test and the residual a rejection draws from.
The grader checks each case against the engine's rule and, exactly, that the emitted token is then
distributed as the target's p whatever the draft's q was (on a vocabulary small enough to enumerate)."""
from __future__ import annotations

import numpy as np

from minillm.course.cases import Case, CaseFailed, case_rng, expect_close, expect_unchanged


def speculative_step_reference(p: np.ndarray, q: np.ndarray, token: int) -> tuple[float, np.ndarray]:
    """(min(1, p[token] / q[token]), norm(max(0, p - q))): engine/speculative/acceptance.py's rule."""
    from minillm.engine.speculative.acceptance import acceptance_probability, residual_distribution
    return acceptance_probability(p, q, token), residual_distribution(p, q, token)


def emitted_distribution(fn, p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """What one speculative step emits, by enumeration: the draft d comes with probability q[d], is kept
    with fn's acceptance probability, else replaced by a draw from fn's residual.   -> [V]"""
    out = np.zeros(len(p))
    for d in np.flatnonzero(q > 0):
        a, residual = fn(p.copy(), q.copy(), int(d))
        out[d] += q[d] * a
        if a < 1:
            out += q[d] * (1 - a) * np.asarray(residual, dtype=np.float64)
    return out


def _spec_cases() -> list[Case]:
    rng = case_rng(20)

    def dist(v, zeros=()):
        x = rng.dirichlet(np.ones(v))
        x[list(zeros)] = 0
        return x / x.sum()
    one_hot = np.eye(5)[2]
    p = dist(5)
    return [Case("random p and q over 5 tokens", dict(p=dist(5), q=dist(5))),
            Case("the draft is better than the target at its token (p < q: accept sometimes)",
                 dict(p=np.array([0.1, 0.6, 0.3]), q=np.array([0.7, 0.2, 0.1]))),
            Case("a deterministic drafter: q is one-hot (ngram, greedy draft)", dict(p=dist(5), q=one_hot)),
            Case("the target gives the draft's token 0 (top-k cut it): always rejected",
                 dict(p=dist(6, zeros=(0, 1)), q=dist(6))),
            Case("the draft never proposes tokens the target likes", dict(p=dist(6), q=dist(6, zeros=(3, 4, 5)))),
            Case("p equals q: every draft accepted", dict(p=p, q=p.copy()))]


def _check_spec(fn, case: Case) -> str:
    p, q = case.inputs["p"], case.inputs["q"]
    for d in np.flatnonzero(q > 0):
        pc, qc = p.copy(), q.copy()
        got = fn(pc, qc, int(d))
        expect_unchanged("p", p, pc)
        expect_unchanged("q", q, qc)
        if not (isinstance(got, tuple) and len(got) == 2):
            raise CaseFailed(f"returned {type(got).__name__}, expected a tuple (acceptance probability, residual)")
        a, residual = got
        want_a, want_r = speculative_step_reference(p, q, int(d))
        if not np.isclose(float(a), want_a, atol=1e-9):
            raise CaseFailed(f"draft token {d}: acceptance probability {float(a):.6g}, expected "
                             f"min(1, p/q) = {want_a:.6g}")
        if want_a < 1:                                   # the residual matters only when rejection can happen
            expect_close(f"draft token {d}: residual", np.asarray(residual, dtype=np.float64), want_r,
                         rtol=1e-6, atol=1e-9)
    emitted = emitted_distribution(fn, p, q)
    summary = expect_close("emitted distribution (enumerated) vs p", emitted, p, rtol=1e-9, atol=1e-12)
    return f"{np.count_nonzero(q)} draft tokens; {summary}"
