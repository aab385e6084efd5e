"""The `logprobs` objects of OpenAI's responses, from the engine's TokenLogprobs (engine/sampling.py).

The values are the log-softmax of the raw logits, before penalties, logit_bias and masks (vLLM's default):
what the model gave each token, not what the request's controls made of it. Two shapes, as OpenAI has them:

    chat         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}
    completions  {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{text: logprob}], "text_offset": [...]}

A token's text is its own bytes decoded alone (a piece of a UTF-8 character shows as U+FFFD; `bytes` has
the real ones).
"""
from __future__ import annotations

from minillm.engine.sampling import TokenLogprob


def token_piece(tokenizer, token: int) -> tuple[str, list[int]]:
    """A token's text alone and its bytes."""
    raw = tokenizer.decode_bytes([token])
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(tokenizer, entries: list[TokenLogprob]) -> dict:
    """Chat's `choices[i].logprobs` for these tokens (one streamed chunk's, or the whole answer's)."""
    def one(token: int, logprob: float) -> dict:
        text, raw = token_piece(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": raw}
    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


class CompletionLogprobs:
    """/v1/completions' `choices[i].logprobs`, chunk after chunk: text_offset counts on across chunks from
    the start of the choice's text (the prompt's, with echo)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.offset = tokenizer, 0

    def __call__(self, entries: list[TokenLogprob], first_prompt_token: int | None = None) -> dict:
        """entries' logprobs; first_prompt_token: echo's first token, which has no logprob (nothing before it)."""
        body = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if first_prompt_token is not None:
            self._add(body, first_prompt_token, None, None)
        for e in entries:
            top = {token_piece(self.tokenizer, t)[0]: lp for t, lp in e.top}
            self._add(body, e.token, e.logprob, top)
        return body

    def _add(self, body: dict, token: int, logprob: float | None, top: dict | None) -> None:
        text = token_piece(self.tokenizer, token)[0]
        body["tokens"].append(text)
        body["token_logprobs"].append(logprob)
        body["top_logprobs"].append(top)
        body["text_offset"].append(self.offset)
        self.offset += len(text)


class ChoiceLogprobs:
    """One choice's logprobs as its step events arrive: each streamed chunk's, and the whole answer's."""

    def __init__(self, tokenizer, chat: bool, echo_ids: list[int] | None = None):
        """echo_ids: the prompt, when its logprobs come first (completions' echo)."""
        self.tokenizer, self.chat, self.echo_ids = tokenizer, chat, echo_ids
        self.completion = CompletionLogprobs(tokenizer)
        self.parts: list[dict] = []

    def chunk(self, event) -> dict | None:
        """The logprobs of this event's tokens (after the prompt's, on the first event with echo); None if none."""
        entries, first = list(getattr(event, "logprobs", None) or []), None
        prompt = getattr(event, "prompt_logprobs", None)
        if prompt is not None and self.echo_ids is not None:
            entries, first = prompt[1:] + entries, self.echo_ids[0]
        if not entries and first is None:
            return None
        part = chat_logprobs(self.tokenizer, entries) if self.chat else self.completion(entries, first)
        self.parts.append(part)
        return part

    def total(self) -> dict:
        """Every chunk's logprobs as one object (a non-streamed answer's)."""
        if self.chat:
            return {"content": [entry for part in self.parts for entry in part["content"]], "refusal": None}
        keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        return {key: [value for part in self.parts for value in part[key]] for key in keys}
