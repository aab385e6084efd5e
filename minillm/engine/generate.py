"""The generation loop: prefill the prompt, then decode one token at a time until a stop.

It measures the two numbers users feel: time to first token (TTFT, dominated by prefill) and
decode speed (tokens per second after the first, dominated by reading the weights once per token).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from minillm.engine.sampling import Sampler, SamplingParams


@dataclass
class Generation:
    text: str
    token_ids: list[int]                 # the new tokens only
    prompt_tokens: int
    ttft_s: float                        # prompt in -> first new token out
    decode_s: float                      # time for the tokens after the first
    finish_reason: str                   # "stop" (EOS or a stop string) or "length"
    token_times_s: list[float] = field(default_factory=list, repr=False)  # per-token latencies

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second over the decode phase (the tokens after the first)."""
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


class ContextOverflow(ValueError):
    pass


def generate_ids(model, prompt_ids: Sequence[int], max_tokens: int, params: SamplingParams,
                 stop_ids: Sequence[int] = (), stop_strings: Sequence[str] = (), tokenizer=None,
                 on_text: Callable[[str], None] | None = None) -> Generation:
    """Generate up to `max_tokens` new tokens after `prompt_ids`, streaming text to `on_text`."""
    context = model.config.max_seq_len
    if len(prompt_ids) == 0:
        raise ValueError("the prompt is empty")
    if len(prompt_ids) >= context:
        raise ContextOverflow(f"the prompt is {len(prompt_ids)} tokens; this model's context is {context}")
    max_tokens = min(max_tokens, context - len(prompt_ids))
    cache = model.new_cache(len(prompt_ids) + max_tokens)
    sampler = Sampler(params)
    text = _TextCollector(tokenizer, stop_strings, on_text)

    start = time.perf_counter()
    logits = model.prefill(prompt_ids, cache)
    new_ids, times, finish = [], [], "length"
    for step in range(max_tokens):
        token = sampler(logits)
        times.append(time.perf_counter())
        if token in stop_ids:
            finish = "stop"
            break
        new_ids.append(token)
        if text.push(token):                       # a stop string appeared
            finish = "stop"
            break
        if step + 1 < max_tokens:
            logits = model.decode(token, cache)
    text.finish()
    ttft = times[0] - start if times else time.perf_counter() - start
    decode_s = times[len(new_ids) - 1] - times[0] if len(new_ids) > 1 else 0.0
    latencies = [b - a for a, b in zip([start] + times, times)]
    return Generation(text.text, new_ids, len(prompt_ids), ttft, decode_s, finish, latencies)


class _TextCollector:
    """Detokenizes as tokens arrive, watches for stop strings, and streams only text that is final.

    Text that could still turn into a stop string is held back until it cannot.
    """

    def __init__(self, tokenizer, stop_strings: Sequence[str], on_text):
        self.decoder = tokenizer.stream_decoder() if tokenizer is not None else None
        self.stops = [s for s in stop_strings if s]
        self.on_text = on_text
        self.text = ""
        self.emitted = 0

    def push(self, token: int) -> bool:
        if self.decoder is None:
            return False
        self.text += self.decoder.push(token)
        for s in self.stops:
            cut = self.text.find(s)
            if cut >= 0:
                self.text = self.text[:cut]
                self._emit(len(self.text))
                return True
        self._emit(len(self.text) - self._held_back())
        return False

    def finish(self) -> None:
        if self.decoder is not None and not any(s in self.text for s in self.stops):
            self.text += self.decoder.flush()
        self._emit(len(self.text))

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def _emit(self, upto: int) -> None:
        if upto > self.emitted:
            if self.on_text is not None:
                self.on_text(self.text[self.emitted:upto])
            self.emitted = upto
