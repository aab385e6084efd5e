"""The generation loop: prefill the prompt, then decode one token at a time until a stop.

It measures the two numbers users feel: time to first token (TTFT, dominated by prefill) and
decode speed (tokens per second after the first, dominated by reading the weights once per token).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from minillm.engine.sampling import Sampler, SamplingParams
from minillm.engine.structured import Grammar, constrained_pick, log_dead_end
from minillm.errors import InvalidValue
from minillm.threads import for_rows


@dataclass
class Generation:
    text: str
    token_ids: list[int]                 # the new tokens only
    prompt_tokens: int
    ttft_s: float                        # prompt in -> first new token out
    decode_s: float                      # time for the tokens after the first
    finish_reason: str                   # "stop" (EOS or a stop string) or "length"
    token_times_s: list[float] = field(default_factory=list, repr=False)  # per-token latencies
    speculative: object | None = None    # speculative decoding's SpeculativeStats (engine/speculative), else None
    note: str | None = None              # one line the caller should see, e.g. max_tokens cut to fit the context
    logprobs: list | None = None         # a TokenLogprob per new token when SamplingParams.logprobs is set
    prompt_logprobs: list | None = None  # per prompt token (None for the first) when prompt logprobs were asked
    content: str | None = None           # with tools: the text before the model's tool calls (engine/tool_calls.py)
    tool_calls: list | None = None       # with tools: the calls, in OpenAI's shape ([] if it made none)

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second over the decode phase (the tokens after the first)."""
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        """Speculative decoding: the fraction of drafted tokens the target accepted (None without it)."""
        return None if self.speculative is None else self.speculative.acceptance_rate

    @property
    def mean_accepted_length(self) -> float | None:
        """Speculative decoding: tokens per target forward pass, accepted drafts + 1 (None without it)."""
        return None if self.speculative is None else self.speculative.mean_accepted_length


class ContextOverflow(InvalidValue):
    """The prompt leaves no room in the model's context for a new token."""


def generate_ids(model, prompt_ids: Sequence[int], max_tokens: int, params: SamplingParams,
                 stop_ids: Sequence[int] = (), stop_strings: Sequence[str] = (), tokenizer=None,
                 on_text: Callable[[str], None] | None = None, grammar: Grammar | None = None) -> Generation:
    """Generate up to `max_tokens` new tokens after `prompt_ids`, streaming text to `on_text`; with a `grammar`
    (structured.py) every token is one it accepts, and the answer ends where it accepts none."""
    context = model.config.max_seq_len
    if len(prompt_ids) == 0:
        raise InvalidValue("the prompt is empty: there is no token to continue from")
    if len(prompt_ids) >= context:
        raise ContextOverflow(f"the prompt is {len(prompt_ids)} tokens; this model's context is {context}")
    max_tokens = min(max_tokens, context - len(prompt_ids))
    cache = model.new_cache(len(prompt_ids) + max_tokens)
    sampler = Sampler(params, prompt_ids)
    state = grammar.start() if grammar is not None else None
    stop_ids = set(stop_ids) | set(params.stop_token_ids)
    logprobs = [] if params.logprobs is not None else None
    text = _TextCollector(tokenizer, stop_strings, on_text)

    start = time.perf_counter()
    for_rows(len(prompt_ids))                      # the BLAS threads each phase runs on (threads.py)
    logits = model.prefill(prompt_ids, cache)
    for_rows(1)
    new_ids, times, finish = [], [], "length"
    for step in range(max_tokens):
        token = constrained_pick(sampler, logits, state)
        times.append(time.perf_counter())
        if token is None or token in stop_ids:      # None: the grammar allows no token here
            if token is None:
                log_dead_end(len(new_ids))
            finish = "stop"
            break
        new_ids.append(token)
        if logprobs is not None:
            logprobs.append(sampler.last_logprob)
        if text.push(token):                       # a stop string appeared
            finish = "stop"
            break
        if step + 1 < max_tokens:
            logits = model.decode(token, cache)
    text.finish()
    ttft = times[0] - start if times else time.perf_counter() - start
    decode_s = times[len(new_ids) - 1] - times[0] if len(new_ids) > 1 else 0.0
    latencies = [b - a for a, b in zip([start] + times, times)]
    return Generation(text.text, new_ids, len(prompt_ids), ttft, decode_s, finish, latencies, logprobs=logprobs)


class _TextCollector:
    """Detokenizes as tokens arrive, watches for stop strings, and streams only text that is final.

    Text that could still turn into a stop string is held back until it cannot. Each stop string is
    matched incrementally (`_StopMatcher`), so a token costs the length of its own text, however long
    the answer and the stop strings are.
    """

    def __init__(self, tokenizer, stop_strings: Sequence[str], on_text):
        self.decoder = tokenizer.stream_decoder() if tokenizer is not None else None
        self.stops = [s for s in stop_strings if s]
        self.matchers = [_StopMatcher(s) for s in self.stops]
        self.on_text = on_text
        self.pieces: list[str] = []        # the text so far, joined when asked for
        self.length = 0
        self.emitted = 0
        self.stopped = False

    @property
    def text(self) -> str:
        if len(self.pieces) > 1:
            self.pieces = ["".join(self.pieces)]
        return self.pieces[0] if self.pieces else ""

    def push(self, token: int) -> bool:
        if self.decoder is None:
            return False
        piece = self.decoder.push(token)
        for i, ch in enumerate(piece):
            ended = [len(m.stop) for m in self.matchers if m.feed(ch)]
            if ended:                                   # stop strings end at piece[i]: cut before the longest
                n = max(ended)
                self._append(piece[:i + 1 - n] if i + 1 >= n else "")
                self._cut(self.length - max(0, n - i - 1))
                self.stopped = True
                self._emit(self.length)
                return True
        self._append(piece)
        self._emit(self.length - max((m.state for m in self.matchers), default=0))
        return False

    def finish(self) -> None:
        if self.decoder is not None and not self.stopped:
            self._append(self.decoder.flush())
        self._emit(self.length)

    def _append(self, piece: str) -> None:
        if piece:
            self.pieces.append(piece)
            self.length += len(piece)

    def _cut(self, length: int) -> None:
        """Drop the text after `length` characters (the start of a stop string that began earlier)."""
        if length < self.length:
            self.pieces, self.length = [self.text[:length]], length

    def _emit(self, upto: int) -> None:
        if upto > self.emitted:
            if self.on_text is not None:
                self.on_text(self.text[self.emitted:upto])
            self.emitted = upto


class _StopMatcher:
    """Knuth-Morris-Pratt over one stop string. `state` is the length of the longest tail of the text
    so far that is a prefix of the stop: the text that must be held back for it."""

    def __init__(self, stop: str):
        self.stop, self.state = stop, 0
        self.fail = [0] * len(stop)          # fail[k]: longest proper border of stop[:k + 1]
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self.fail[i] = k

    def feed(self, ch: str) -> bool:
        """One more character of text; True when the stop string ends with it."""
        k, stop = self.state, self.stop
        while k and stop[k] != ch:
            k = self.fail[k - 1]
        if stop[k] == ch:
            k += 1
        if k == len(stop):
            self.state = self.fail[k - 1]
            return True
        self.state = k
        return False
