"""Turning logits into the next token: greedy, temperature, top-k, top-p (nucleus), seeded.

The filters run in HF's order (temperature, then top-k, then top-p), so a seed and the same
settings pick from the same distribution HF would.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from minillm.errors import InvalidValue


@dataclass
class SamplingParams:
    temperature: float = 0.0        # 0 means greedy: always the most likely token
    top_k: int | None = None        # keep only the k most likely tokens
    top_p: float | None = None      # keep the smallest set whose probability reaches p
    seed: int | None = None

    def __post_init__(self):
        # NaN passes every comparison's `not`, and inf divides the logits to all-zero or NaN: say so here,
        # where Python callers and the CLI both come through, not as a NumPy error mid-generation.
        if not _is_number(self.temperature) or not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidValue(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k is not None and not (_is_int(self.top_k) and self.top_k >= 1):
            raise InvalidValue(f"top-k must be an integer >= 1, got {self.top_k}")
        if self.top_p is not None and not (_is_number(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise InvalidValue(f"top-p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not (_is_int(self.seed) and self.seed >= 0):   # NumPy's generators take >= 0
            raise InvalidValue(f"seed must be an integer >= 0, got {self.seed}")


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def top_k_filter(logits: np.ndarray, k: int) -> np.ndarray:
    """Set every logit below the k-th largest to -inf.    logits: [vocab]"""
    if k >= logits.shape[-1]:
        return logits
    kth = np.partition(logits, -k)[-k]
    return np.where(logits < kth, -np.inf, logits)


def top_p_filter(logits: np.ndarray, p: float) -> np.ndarray:
    """Keep the most likely tokens until their probability mass reaches p; drop the rest.

    The token that crosses p is kept, so at least one token always survives.   logits: [vocab]
    """
    order = np.argsort(-logits, kind="stable")                  # most likely first
    probs = softmax(logits[order])
    mass_before = np.cumsum(probs) - probs                      # mass of the tokens ranked above each
    drop = order[mass_before >= p]
    out = logits.copy()
    out[drop] = -np.inf
    return out


def softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max())
    return e / e.sum()


def next_token_distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The probabilities `sample` draws from (for lessons and tests).    -> [vocab]"""
    logits = logits.astype(np.float64) / max(params.temperature, 1e-8)
    if params.top_k is not None:
        logits = top_k_filter(logits, params.top_k)
    if params.top_p is not None and params.top_p < 1.0:
        logits = top_p_filter(logits, params.top_p)
    return softmax(logits)


CDF_CHUNK = 256      # inverse_cdf_pick's first level: one partial sum per this many tokens


def inverse_cdf_pick(logits: np.ndarray, temperature: float, u: float) -> int:
    """The token whose interval of the softmax(logits / temperature) CDF holds u in [0, 1): what
    rng.choice(vocab, p=probs) picks for the same uniform u, without a cumsum over the whole vocabulary
    (a sequential scan: ~0.1 ms at 32k tokens on a laptop core, most of a sampled step's host time).
    Two levels instead: a sum per CDF_CHUNK tokens, the cumsum of those sums to find u's chunk, then
    the cumsum inside that one chunk. -inf logits (filtered out) weigh 0 and are never picked.  logits: [vocab]"""
    top = logits.max()
    e = np.exp((logits - top) * np.float32(1.0 / temperature), dtype=np.float32)      # [vocab], max 1
    starts = np.arange(0, len(e), CDF_CHUNK)
    cum = np.cumsum(np.add.reduceat(e, starts, dtype=np.float64))                      # [chunks]
    target = u * cum[-1]
    c = min(int(np.searchsorted(cum, target, side="right")), len(cum) - 1)
    inside = np.cumsum(e[starts[c]:starts[c] + CDF_CHUNK], dtype=np.float64) + (cum[c - 1] if c else 0.0)
    i = min(int(np.searchsorted(inside, target, side="right")), len(inside) - 1)
    while e[starts[c] + i] == 0.0:             # rounding put target past the chunk's last real token
        i -= 1
    return int(starts[c] + i)


class Sampler:
    """Holds the random state, so a seeded generation is reproducible token for token."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        p = self.params
        if p.temperature == 0.0:
            return int(np.argmax(logits))
        if p.top_p is None or p.top_p >= 1.0:      # temperature (and top-k): the fast pick, one uniform draw
            if p.top_k is not None:
                logits = top_k_filter(logits, p.top_k)
            return inverse_cdf_pick(logits, p.temperature, self.rng.random())
        probs = next_token_distribution(logits, p)
        return int(self.rng.choice(len(probs), p=probs))
