"""Speculative decoding for one sequence: draft k tokens, verify them in one target pass, keep what the
acceptance rule accepts, roll the caches back past the rest.

    cache: [prompt .. t_j-1]      pending token t_j (sampled, not yet run)
    draft d_1..d_k                the drafter's guess of what follows t_j
    verify forward([t_j, d_1..d_k]) -> logits [k + 1, vocab]; row i judges d_{i+1}, row k gives the bonus
    accept -> d_1..d_n and one more token; cache.truncate(back to t_j, d_1..d_n)

A drafter with nothing to propose makes the verify pass a plain decode step, so the loop never does
worse than plain decoding by more than the drafter's own time. Stops (EOS, stop strings, max_tokens)
are checked token by token inside an accepted run, exactly where plain decoding would stop.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

from minillm.engine.generate import ContextOverflow, Generation, _TextCollector
from minillm.engine.sampling import Sampler, SamplingParams
from minillm.engine.speculative.acceptance import accept_draft
from minillm.errors import InvalidValue
from minillm.threads import for_rows


@dataclass
class SpeculativeStats:
    """What speculation did: drafted and accepted tokens, target passes after the prefill, and where
    the time went."""
    draft_tokens: int = 0          # proposed by the drafter
    accepted_tokens: int = 0       # of those, accepted by the target
    target_forwards: int = 0       # verify passes (each emits accepted + 1 tokens)
    draft_s: float = 0.0
    verify_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens one target pass produced on average: accepted drafts + the corrected or bonus token."""
        return (self.accepted_tokens + self.target_forwards) / self.target_forwards if self.target_forwards else 0.0


def generate_speculative(model, drafter, prompt_ids: Sequence[int], max_tokens: int, params: SamplingParams,
                         k: int = 4, stop_ids: Sequence[int] = (), stop_strings: Sequence[str] = (),
                         tokenizer=None, on_text: Callable[[str], None] | None = None) -> Generation:
    """generate_ids with a drafter: the same tokens (greedy) or the same distribution (sampling), in fewer
    target passes. -> Generation with `.speculative` (SpeculativeStats) filled in."""
    context_len = model.config.max_seq_len
    if len(prompt_ids) == 0:
        raise InvalidValue("the prompt is empty: there is no token to continue from")
    if len(prompt_ids) >= context_len:
        raise ContextOverflow(f"the prompt is {len(prompt_ids)} tokens; this model's context is {context_len}")
    if k < 1:
        raise ValueError(f"draft tokens must be >= 1, got {k}")
    max_tokens = min(max_tokens, context_len - len(prompt_ids))
    cache = model.new_cache(len(prompt_ids) + max_tokens, spare=k)
    drafter.begin(prompt_ids, len(prompt_ids) + max_tokens, k)
    sampler = Sampler(params)                     # one random stream: first token, drafts, acceptances
    rule = getattr(getattr(model, "pieces", None), "speculative_rule", None)   # a student's accept step, or None
    text = _TextCollector(tokenizer, stop_strings, on_text)
    stats = SpeculativeStats()

    start = time.perf_counter()
    for_rows(len(prompt_ids))                     # the BLAS threads each phase runs on (threads.py)
    emitted = [sampler(model.prefill(prompt_ids, cache))]
    context, new_ids, times, finish = list(prompt_ids), [], [], "length"
    while True:
        finish = _take(emitted, context, new_ids, times, stop_ids, text, max_tokens)
        if finish is not None:
            break
        # at most max_tokens in all: a pass emits its drafts and one more, so draft one fewer than is left
        n_draft = min(k, max_tokens - len(new_ids) - 1)
        t0 = time.perf_counter()
        draft, q = drafter.propose(context, n_draft, params, sampler.rng) if n_draft > 0 else ([], None)
        draft = draft[:n_draft]
        t1 = time.perf_counter()
        for_rows(1 + len(draft))
        # the verify pass: a prefill of the pending token and the drafts, every row's logits on the host
        logits = model.prefill([context[-1]] + draft, cache, all_logits=True)             # [1 + n, vocab]
        emitted = accept_draft(draft, q, logits, params, sampler.rng, rule)
        cache.truncate(len(context) + len(emitted) - 1)   # the pending token and the accepted drafts stay
        stats.draft_s += t1 - t0
        stats.verify_s += time.perf_counter() - t1
        stats.draft_tokens += len(draft)
        stats.accepted_tokens += len(emitted) - 1
        stats.target_forwards += 1
    text.finish()
    ttft = times[0] - start if times else time.perf_counter() - start
    decode_s = times[len(new_ids) - 1] - times[0] if len(new_ids) > 1 else 0.0
    latencies = [b - a for a, b in zip([start] + times, times)]
    return Generation(text.text, new_ids, len(prompt_ids), ttft, decode_s, finish, latencies, speculative=stats)


def _take(emitted: list[int], context: list[int], new_ids: list[int], times: list[float], stop_ids,
          text: _TextCollector, max_tokens: int) -> str | None:
    """Append one pass's tokens under plain decoding's rules, one at a time; -> the finish reason if one
    of them ends the answer (EOS is not output; a stop string cuts the text; max_tokens), else None."""
    now = time.perf_counter()
    for token in emitted:
        times.append(now)
        if token in stop_ids:
            return "stop"
        new_ids.append(token)
        context.append(token)
        if text.push(token):
            return "stop"
        if len(new_ids) >= max_tokens:
            return "length"
    return None
