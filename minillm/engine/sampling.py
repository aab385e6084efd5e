"""Turning logits into the next token: the sampling controls, then greedy or a seeded draw.

The steps run in this order on a request's logits row (HF's generate applies its processors in it too):

  1. logit_bias          logits[id] += bias                                         (OpenAI's logit_bias)
  2. repetition_penalty  each token in the prompt or the output: l / r if l > 0, else l * r     (CTRL, HF)
  3. frequency_penalty,  l -= frequency * count(id in the output) + presence * (count > 0)      (OpenAI,
     presence_penalty    over the generated tokens only; vLLM reads them the same way)
  4. token mask          tokens the request may not take -> -inf  (`Sampler.allowed_tokens`, structured output)
  5. temperature         0: greedy, the argmax of steps 1-4
  6. top_k, 7. top_p, 8. min_p   (min_p keeps tokens with probability >= min_p x the top token's)

Logprobs (`SamplingParams.logprobs`) are the log-softmax of the raw logits, before every step above (vLLM's
default): what the model said, not what the controls made of it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from minillm.errors import InvalidValue

MAX_LOGPROBS = 20                    # top alternatives per token at most, as OpenAI allows
MAX_LOGIT_BIAS = 100.0               # |bias| at most, as OpenAI allows


@dataclass
class SamplingParams:
    temperature: float = 0.0        # 0 means greedy: always the most likely token
    top_k: int | None = None        # keep only the k most likely tokens
    top_p: float | None = None      # keep the smallest set whose probability reaches p
    seed: int | None = None
    min_p: float = 0.0              # drop tokens less likely than min_p x the most likely one; 0 = off
    presence_penalty: float = 0.0   # -2..2: subtracted once from every token the output already holds
    frequency_penalty: float = 0.0  # -2..2: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # > 0: divides (multiplies, if negative) the logits of tokens seen anywhere
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id -> added to its logit, -100..100
    stop_token_ids: tuple[int, ...] = ()   # sampling one of these ends the answer (not output), like EOS
    logprobs: int | None = None     # report each chosen token's logprob and this many top alternatives

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
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if not (_is_number(self.repetition_penalty) and math.isfinite(self.repetition_penalty)
                and self.repetition_penalty > 0):
            raise InvalidValue(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        for token, bias in self.logit_bias.items():
            if not (_is_int(token) and token >= 0):
                raise InvalidValue(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            _check_range(f"logit_bias[{token}]", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        self.stop_token_ids = tuple(self.stop_token_ids)
        if any(not (_is_int(t) and t >= 0) for t in self.stop_token_ids):
            raise InvalidValue(f"stop_token_ids must be token ids (integers >= 0), got {list(self.stop_token_ids)}")
        if self.logprobs is not None and not (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidValue(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def changes_logits(self) -> bool:
        """Do steps 1-3 (bias, penalties) change anything?"""
        return bool(self.logit_bias) or self.repetition_penalty != 1.0 or bool(self.presence_penalty) \
            or bool(self.frequency_penalty)

    def check_speculative(self) -> None:
        """Speculative decoding verifies drafts against temperature, top-k, top-p and min-p only: penalties
        (which change with every accepted draft), logit_bias and logprobs are refused in one line."""
        asked = [name for name, on in (("presence_penalty", self.presence_penalty),
                                       ("frequency_penalty", self.frequency_penalty),
                                       ("repetition_penalty", self.repetition_penalty != 1.0),
                                       ("logit_bias", self.logit_bias), ("logprobs", self.logprobs is not None)) if on]
        if asked:
            raise InvalidValue(f"{asked[0]} does not run with speculative decoding (--speculative) yet")

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse token ids this model does not have (logit_bias keys, stop_token_ids)."""
        for name, ids in (("logit_bias", self.logit_bias), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise InvalidValue(f"{name}: token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _check_range(name: str, value, low: float, high: float) -> None:
    if not (_is_number(value) and low <= value <= high):      # NaN fails both comparisons
        raise InvalidValue(f"{name} must be a number in [{low:g}, {high:g}], got {value}")


# ---- steps 1-4: what the request's own rules do to the logits ---------------------------------------

class TokenHistory:
    """The tokens the penalties look at: which ids the prompt holds, and how often each output id came."""

    def __init__(self, prompt_ids=()):
        self.prompt_ids = np.unique(np.asarray(prompt_ids, dtype=np.int64))   # [distinct prompt ids]
        self.output_counts: dict[int, int] = {}

    def append(self, token: int) -> None:
        self.output_counts[token] = self.output_counts.get(token, 0) + 1

    def output(self) -> tuple[np.ndarray, np.ndarray]:
        """-> (ids, counts), each [distinct output ids]."""
        ids = np.fromiter(self.output_counts, dtype=np.int64, count=len(self.output_counts))
        counts = np.fromiter(self.output_counts.values(), dtype=np.float64, count=len(self.output_counts))
        return ids, counts


def apply_logit_bias(logits: np.ndarray, bias: dict[int, float]) -> np.ndarray:
    """Step 1: add each bias to its token's logit.    logits: [vocab]"""
    out = logits.copy()
    ids = np.fromiter(bias, dtype=np.int64, count=len(bias))
    out[ids] += np.fromiter(bias.values(), dtype=np.float64, count=len(bias)).astype(out.dtype)
    return out


def apply_repetition_penalty(logits: np.ndarray, seen: np.ndarray, penalty: float) -> np.ndarray:
    """Step 2: every token already seen (`seen` [n] ids, prompt and output) made less likely by `penalty`:
    a positive logit divided by it, a negative one multiplied (both move away from being picked)."""
    out = logits.copy()
    scores = out[seen]
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):   # extreme penalties: see the clip
        penalized = np.where(scores > 0, scores / penalty, scores * penalty)
    # past the float range a logit would become inf (and inf - inf NaN in the softmax): it stops at the edge,
    # where it is as sure a pick (or as sure a miss) as it can be; a masked -inf stays -inf
    edge = np.finfo(out.dtype).max
    out[seen] = np.where(np.isneginf(scores), scores, np.clip(penalized, -edge, edge))
    return out


def apply_presence_frequency(logits: np.ndarray, ids: np.ndarray, counts: np.ndarray, presence: float,
                             frequency: float) -> np.ndarray:
    """Step 3: each output token's logit minus frequency x its count, minus presence once.   ids, counts: [n]"""
    out = logits.copy()
    out[ids] -= (frequency * counts + presence).astype(out.dtype)
    return out


def apply_token_mask(logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """Step 4: tokens not `allowed` (bool [vocab]) can never be picked."""
    return np.where(allowed, logits, -np.inf)


def processed_logits(logits: np.ndarray, params: SamplingParams, history: TokenHistory,
                     allowed: np.ndarray | None = None) -> np.ndarray:
    """Steps 1-4 on one row (a copy; the raw row stays for logprobs).    logits: [vocab]"""
    if params.logit_bias:
        logits = apply_logit_bias(logits, params.logit_bias)
    if params.repetition_penalty != 1.0:
        ids, _ = history.output()
        logits = apply_repetition_penalty(logits, np.union1d(history.prompt_ids, ids), params.repetition_penalty)
    if params.presence_penalty or params.frequency_penalty:
        ids, counts = history.output()
        logits = apply_presence_frequency(logits, ids, counts, params.presence_penalty, params.frequency_penalty)
    if allowed is not None:
        logits = apply_token_mask(logits, allowed)
    return logits


# ---- steps 5-8: the distribution the token is drawn from --------------------------------------------

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


def min_p_filter(logits: np.ndarray, min_p: float) -> np.ndarray:
    """Drop every token whose probability is below min_p x the most likely token's (the most likely one
    always stays): the cut follows the model's confidence, where top-p's follows the mass.  logits: [vocab]"""
    relative = np.exp(logits - logits.max())                    # p_i / p_max, [vocab]
    return np.where(relative < min_p, -np.inf, logits)


def softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max())
    return e / e.sum()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log p for every token, in float64.    logits: [vocab]"""
    shifted = logits.astype(np.float64) - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


def next_token_distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The probabilities `sample` draws from, steps 5-8 (for lessons and tests).    -> [vocab]"""
    logits = logits.astype(np.float64) / max(params.temperature, 1e-8)
    if params.top_k is not None:
        logits = top_k_filter(logits, params.top_k)
    if params.top_p is not None and params.top_p < 1.0:
        logits = top_p_filter(logits, params.top_p)
    if params.min_p:
        logits = min_p_filter(logits, params.min_p)
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


# ---- logprobs -----------------------------------------------------------------------------------------

@dataclass
class TokenLogprob:
    """One position's logprobs: the token there, its log-probability, and the `top` most likely tokens."""
    token: int
    logprob: float
    top: list[tuple[int, float]]     # (token id, logprob), most likely first; [] when none were asked for


def token_logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """`token`'s logprob under the raw `logits` [vocab], with the `top` most likely alternatives."""
    logp = log_softmax(logits)                                           # [vocab]
    top = min(top, len(logp))
    best = np.argpartition(-logp, top - 1)[:top] if top else np.empty(0, dtype=np.int64)
    best = best[np.argsort(-logp[best], kind="stable")]
    return TokenLogprob(int(token), float(logp[token]), [(int(t), float(logp[t])) for t in best])


# ---- the pick -----------------------------------------------------------------------------------------

class Sampler:
    """One request's picks: its random state (a seeded generation is reproducible token for token), the
    tokens its penalties count, and the logprob of its last pick when asked for."""

    def __init__(self, params: SamplingParams, prompt_ids=()):
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        self.history = TokenHistory(prompt_ids if params.repetition_penalty != 1.0 else ())
        self.allowed_tokens: np.ndarray | None = None    # step 4's mask (bool [vocab]) for the next pick
        self.last_logprob: TokenLogprob | None = None    # the last pick's, when params.logprobs is set

    @property
    def argmax_only(self) -> bool:
        """Is the next pick the raw row's argmax and nothing else? (Then a runner may pick it on the device.)"""
        p = self.params
        return p.temperature == 0.0 and not p.changes_logits and p.logprobs is None and self.allowed_tokens is None

    def __call__(self, logits: np.ndarray) -> int:
        p = self.params
        raw = logits
        if p.changes_logits or self.allowed_tokens is not None:
            logits = processed_logits(logits, p, self.history, self.allowed_tokens)
        token = self._pick(logits)
        if p.logprobs is not None:
            self.last_logprob = token_logprob(raw, token, p.logprobs)
        if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
            self.history.append(token)
        return token

    def _pick(self, logits: np.ndarray) -> int:
        p = self.params
        if p.temperature == 0.0:
            return int(np.argmax(logits))
        if (p.top_p is None or p.top_p >= 1.0) and not p.min_p:   # temperature (and top-k): one uniform draw
            if p.top_k is not None:
                logits = top_k_filter(logits, p.top_k)
            return inverse_cdf_pick(logits, p.temperature, self.rng.random())
        probs = next_token_distribution(logits, p)
        return int(self.rng.choice(len(probs), p=probs))
