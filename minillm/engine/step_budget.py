"""How many prompt tokens one engine step may take while other requests wait on it (chunked prefill's budget).

A step is one forward pass, and every request in it waits for the whole of it. On a CPU a step of
SmolLM2-135M with prompt tokens in it costs ~70-100 ms whatever its size (each matmul packs the weights
once) plus ~2 ms a token, so a prompt's 512-token chunk makes a ~1 s step, and a request decoding beside
it gets one token a second. While more than one request has work (a prompt beside decodes, or beside
another prompt), the scheduler takes every decode and only as many prompt tokens as keep the step near a
target time:

    step_s ~= fixed_s + per_token_s * tokens  ->  prompt tokens = (target_s - fixed_s) / per_token_s - decodes

Both terms are measured as the engine runs, on this machine under its present load: a least-squares line
through the recent steps that carried prompt tokens (each step's weight decays by DECAY a step, so a
busier machine shrinks the chunks within a few steps). Decode-only steps are left out: one or a few rows
run as matrix-vector products, a cheaper kind of step than the line describes. Steps of one size alone
would fit any line through their point, so the chunk alternates a fifth above and below its size (the
decodes' token gaps with it); until two sizes were timed, all of a step's time counts as per-token cost,
and a fit that noise tilts (a negative term) keeps the last line.

Each step pays `fixed_s` again, so small chunks make the prompt's own first token later. Two floors keep
that bounded: a prompt with no other request beside it is not throttled at all (scheduler.py), and
beside others its tokens take at least PROMPT_TO_FIXED times `fixed_s`, so at least three quarters of
every step is prefill (its first token at most ~1/3 later than with no fixed cost) even where `fixed_s`
alone is near the target; the others then wait longer than the target for each token, but never for a step
longer than STEP_CAP times the target (what a chat beside a long prompt must not wait past: a second).
"""
from __future__ import annotations

import time
from typing import Callable

DEFAULT_TARGET_STEP_MS = 200.0  # well under a second between tokens; bench serve --workload mixed measures it
MIN_PROMPT_TOKENS = 16          # however slow the machine, a prompt beside decodes still moves forward
PROMPT_TO_FIXED = 3             # beside decodes, a step's prompt tokens take at least 3x its fixed cost
STEP_CAP = 3                    # ... but that floor never makes a step longer than 3x the target (0.6 s at 200 ms)
DECAY = 0.9                     # each older step counts this much less in the fit
WOBBLE = 0.2                    # chunks alternate between 1 + WOBBLE and 1 - WOBBLE times their size


class StepBudget:
    """Sizes a step's prompt chunk beside `decode_tokens` decodes so the step lasts about `target_s`."""

    def __init__(self, target_s: float, max_tokens: int, clock: Callable[[], float] = time.perf_counter):
        """max_tokens: the most a step computes in all (the engine's max_batch_tokens); clock: seconds (tests
        pass a fake one)."""
        self.target_s, self.max_tokens, self.clock = target_s, max_tokens, clock
        self._sums = [0.0] * 5           # decayed sums over steps with prompt tokens: 1, n, s, n*n, n*s
        self._line: tuple[float, float] | None = None    # the last line the sums fitted
        self._wobble = WOBBLE

    def fit(self) -> tuple[float, float] | None:
        """(fixed_s, per_token_s) of the line step_s = fixed_s + per_token_s * tokens; None before any step."""
        w, n, s, nn, ns = self._sums
        if w == 0:
            return None
        spread = w * nn - n * n                              # w^2 * the variance of the step sizes
        if spread > 1e-9 * n * n:
            per_token_s = (w * ns - n * s) / spread
            fixed_s = (s - per_token_s * n) / w
            if per_token_s > 0 and fixed_s >= 0:             # else noise tilted it: keep the last line
                self._line = fixed_s, per_token_s
        return self._line or (0.0, s / n)                    # one size timed so far: all of it per token

    def prompt_tokens(self, decode_tokens: int) -> int:
        """Prompt tokens a step beside `decode_tokens` decode tokens may take."""
        room = self.max_tokens - decode_tokens
        line = self.fit()
        if line is None:                                     # nothing timed yet: this step will be
            return max(0, room)
        fixed_s, per_token_s = line
        fits = (self.target_s - fixed_s) / per_token_s - decode_tokens
        floor = PROMPT_TO_FIXED * fixed_s / per_token_s
        cap = (STEP_CAP * self.target_s - fixed_s) / per_token_s - decode_tokens
        self._wobble = -self._wobble
        size = max(MIN_PROMPT_TOKENS, min(max(fits, floor), cap))
        return max(0, min(room, int(size * (1 + self._wobble))))

    def record(self, decode_tokens: int, prompt_tokens: int, step_s: float) -> None:
        """A step of that many decode and prompt tokens took step_s seconds."""
        if prompt_tokens == 0:
            return
        n = decode_tokens + prompt_tokens
        self._sums = [DECAY * old + new for old, new in zip(self._sums, (1.0, n, step_s, n * n, n * step_s))]
