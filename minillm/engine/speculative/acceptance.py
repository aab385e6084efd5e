"""The acceptance rule of speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

A drafter proposed tokens d_1..d_k, d_i drawn from its distribution q_i; the target's one pass gives p_i
at every position (p_{k+1} after the last draft). Walking left to right:

    accept d_i with probability min(1, p_i(d_i) / q_i(d_i));
    on the first rejection emit a token drawn from norm(max(0, p_i - q_i)) and stop;
    if all k are accepted, emit a bonus token drawn from p_{k+1}.

Each emitted token is then distributed exactly as p (accepted mass q·min(1, p/q) = min(p, q), plus the
rejected mass times the residual = p - min(p, q)). A deterministic drafter (ngram, any greedy draft) has
q = one-hot(d_i): accept with probability p_i(d_i), else draw from p_i with d_i removed. At temperature 0
the rule is argmax comparison: accept while d_i is the target's argmax, then emit the argmax.

p and q are both the *filtered* distributions (temperature, top-k, top-p: sampling.next_token_distribution)
that plain sampling would draw from, so speculation samples exactly what plain decoding samples.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from minillm.engine.sampling import SamplingParams, next_token_distribution


def acceptance_probability(p: np.ndarray, q: np.ndarray | None, token: int) -> float:
    """min(1, p(token) / q(token)); q None means the drafter was deterministic (q = one-hot)."""
    q_token = 1.0 if q is None else float(q[token])
    return min(1.0, float(p[token]) / q_token) if q_token > 0 else 1.0


def residual_distribution(p: np.ndarray, q: np.ndarray | None, token: int) -> np.ndarray:
    """norm(max(0, p - q)): what a rejection draws from.   p, q: [vocab] -> [vocab]"""
    if q is None:
        r = p.copy()
        r[token] = 0.0                                          # p - one-hot(token), clipped
    else:
        r = np.maximum(p - q, 0.0)
    total = r.sum()
    return r / total if total > 0 else p                        # only reachable by rounding: p == q


def accept_draft(draft: Sequence[int], draft_probs: np.ndarray | None, target_logits: np.ndarray,
                 params: SamplingParams, rng: np.random.Generator, rule=None) -> list[int]:
    """The tokens one verify pass emits: the accepted prefix of `draft`, then one more.

    draft: [n] proposed tokens; draft_probs: [n, vocab] the drafter's filtered q_i (None: deterministic);
    target_logits: [n + 1, vocab], row i the target's logits for the token after draft[:i].
    rule: (acceptance probability, residual) functions of a student's (course/student.py); None: these.
    -> 1 .. n + 1 tokens."""
    if params.temperature == 0.0:
        best = np.argmax(target_logits, axis=-1)                # [n + 1]
        n = 0
        while n < len(draft) and draft[n] == best[n]:
            n += 1
        return list(draft[:n]) + [int(best[n])]
    acceptance, residual_of = rule or (acceptance_probability, residual_distribution)
    for i, token in enumerate(draft):
        p = next_token_distribution(target_logits[i], params)   # [vocab]
        q = None if draft_probs is None else draft_probs[i]
        if rng.random() >= acceptance(p, q, token):
            residual = residual_of(p, q, token)
            return list(draft[:i]) + [int(rng.choice(len(residual), p=residual))]
    p = next_token_distribution(target_logits[len(draft)], params)
    return list(draft) + [int(rng.choice(len(p), p=p))]        # all accepted: the bonus token
