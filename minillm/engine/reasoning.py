"""Reasoning output: what a thinking model reasons comes back apart from its answer.

Qwen3 (and the DeepSeek-R1 distills) write their reasoning between <think> and </think>, then the answer.
The chat API returns the reasoning as `message.reasoning_content` (streamed: `delta.reasoning_content`) and
the answer as `content`, the fields vLLM's qwen3 reasoning parser and llama.cpp's server use; `minillm
generate` prints it dimmed under a label. The rules, for a stream and for a whole answer alike:

* Reasoning opens only with a <think> at the very start of the answer (whitespace before it allowed), or
  at the start when the prompt itself ends in <think> (templates that open it for the model). A <think>
  later in the answer is text. An answer that opens none is all content (Qwen3 with enable_thinking=false:
  the template wrote an empty <think></think> into the prompt).
* It closes at </think>. Whitespace around the reasoning, and right after </think> (the template's
  "\\n\\n"), is dropped, as llama.cpp does. An answer cut off before </think> is all reasoning.

`ReasoningSplitter` is the one place that cuts: `push(text)` takes the next piece of a stream and returns
the (reasoning, content) it can already tell apart, holding back a possible partial tag or whitespace whose
side is not known yet; `finish()` returns what was held. `splitter_for` picks the splitter a model needs
(None: the model does not reason), so another syntax (GPT-OSS's harmony channels) is another class with
push/finish and another branch there: `HarmonySplitter`, below.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ThinkTags:
    """The strings that open and close a model's reasoning."""
    open: str = "<think>"
    close: str = "</think>"


THINK = ThinkTags()


class ReasoningSplitter:
    """Cuts a streamed answer into reasoning and content, tag by tag (see the module's rules)."""

    def __init__(self, tags: ThinkTags = THINK, opened_in_prompt: bool = False):
        self.tags = tags
        # "start": not yet known whether the answer opens with reasoning; "reasoning"; "after" the close tag
        # (its whitespace dropped); "content": everything from here on is the answer.
        self.state = "reasoning" if opened_in_prompt else "start"
        self.held = ""                  # text not yet given out: a possible partial tag, or whitespace
        self.reasoned = False           # some reasoning text was given out (leading whitespace is dropped)
        self.opened = opened_in_prompt  # reasoning was opened: the answer has a reasoning part, maybe empty

    def push(self, text: str) -> tuple[str, str]:
        """The next piece of the answer -> (reasoning, content) that can be told apart now."""
        self.held += text
        reasoning, content = "", ""
        while True:
            if self.state == "start":
                stripped = self.held.lstrip()
                if stripped.startswith(self.tags.open):
                    self.held, self.state, self.opened = stripped[len(self.tags.open):], "reasoning", True
                elif self.tags.open.startswith(stripped):       # whitespace or a partial tag: wait and see
                    return reasoning, content
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                end = self.held.find(self.tags.close)
                if end >= 0:
                    reasoning += self._reasoning(self.held[:end].rstrip())
                    self.held, self.state = self.held[end + len(self.tags.close):], "after"
                    continue
                keep = partial_suffix(self.held, self.tags.close)
                give = self.held[:len(self.held) - keep].rstrip()
                reasoning += self._reasoning(give)
                self.held = self.held[len(give):]               # whitespace and a partial tag: maybe the end
                return reasoning, content
            elif self.state == "after":
                self.held = self.held.lstrip()
                if not self.held:
                    return reasoning, content
                self.state = "content"
            else:
                content, self.held = content + self.held, ""
                return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The end of the answer -> whatever was held back: unclosed reasoning stays reasoning."""
        held, self.held = self.held, ""
        if self.state == "reasoning":
            return self._reasoning(held.rstrip()), ""
        if self.state == "start":
            return "", held
        return "", held if self.state == "content" else ""

    def _reasoning(self, text: str) -> str:
        if not self.reasoned:
            text = text.lstrip()
        self.reasoned |= bool(text)
        return text


def split_reasoning(text: str, tags: ThinkTags = THINK, opened_in_prompt: bool = False) -> tuple[str | None, str]:
    """A whole answer -> (reasoning or None when it had none, content)."""
    splitter = ReasoningSplitter(tags, opened_in_prompt)
    r1, c1 = splitter.push(text)
    r2, c2 = splitter.finish()
    reasoning = r1 + r2
    return (reasoning if splitter.opened and reasoning else None), c1 + c2


def splitter_for(tokenizer, prompt_ids=None) -> ReasoningSplitter | None:
    """A fresh splitter for one answer of this model, or None when it has no reasoning syntax: a tokenizer
    with <think> and </think> tokens (Qwen3, DeepSeek-R1 distills). prompt_ids: the prompt, whose end may
    already have opened the reasoning."""
    if is_harmony(tokenizer):                           # GPT-OSS: harmony channels, not tags
        return HarmonySplitter()
    if tokenizer is None or tokenizer.token_to_id(THINK.open) is None or tokenizer.token_to_id(THINK.close) is None:
        return None
    tail = tokenizer.decode(list(prompt_ids)[-4:]) if prompt_ids else ""
    return ReasoningSplitter(THINK, opened_in_prompt=tail.rstrip().endswith(THINK.open))


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a start of `tag` (a tag that may be arriving)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def split_answer(tokenizer, prompt_ids, text: str) -> tuple[str | None, str]:
    """A whole answer of this model -> (its reasoning or None, its content): the text as it is for a model
    without a reasoning syntax."""
    splitter = splitter_for(tokenizer, prompt_ids)
    if splitter is None:
        return None, text
    if isinstance(splitter, HarmonySplitter):
        (r1, c1), (r2, c2) = splitter.push(text), splitter.finish()
        return (r1 + r2 if splitter.opened else None), c1 + c2
    return split_reasoning(text, splitter.tags, splitter.state == "reasoning")


# ---- GPT-OSS: the harmony format's channels ---------------------------------------------------------
HARMONY_MESSAGE, HARMONY_CHANNEL = "<|message|>", "<|channel|>"
HARMONY_ENDS = ("<|end|>", "<|return|>", "<|call|>")      # a message ends; <|return|> and <|call|> end the turn


class HarmonySplitter:
    """Cuts a GPT-OSS answer into reasoning and content by harmony channel. The answer is a run of messages,
    each a header and a body: `<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final
    <|message|>...<|return|>` (the first header's `<|start|>assistant` is the prompt's). The analysis
    channel's bodies are reasoning, the others' content (final; commentary: a preamble); the headers and the
    special tokens between go to neither. A message to a recipient (`to=functions.NAME`: a tool call) goes to
    content whole, in the one form tool_calls.py parses (`harmony_call`). Text before any header is content. As
    ReasoningSplitter: push(text) -> (reasoning, content) told apart so far, holding back a possible
    partial token; finish() -> what was held (a message cut off keeps its channel)."""

    def __init__(self):
        self.state = "start"            # "start" (no header seen), "header", "body", or "plain" (no headers at all)
        self.channel = ""               # the body's channel
        self.recipient = None           # the body's recipient (`to=functions.NAME`): the body is a tool call
        self.held = ""
        self.opened = False             # some analysis message was seen: the answer has a reasoning part

    def push(self, text: str) -> tuple[str, str]:
        self.held += text
        out = {"reasoning": "", "content": ""}
        while True:
            if self.state == "start":
                stripped = self.held.lstrip()
                if len(stripped) < 3 and any(m.startswith(stripped) for m in ("<|", "to=")):
                    return out["reasoning"], out["content"]              # nothing, or one "<": wait and see
                self.state = "header" if stripped.startswith(("<|", "to=")) else "plain"
            elif self.state == "header":
                end = self.held.find(HARMONY_MESSAGE)
                if end < 0:
                    return out["reasoning"], out["content"]
                self.channel, self.recipient = _channel_of(self.held[:end]), _recipient_of(self.held[:end])
                self.opened |= self.channel == "analysis" and self.recipient is None
                if self.recipient is not None:
                    out["content"] += harmony_call(self.recipient, self.channel)
                self.held, self.state = self.held[end + len(HARMONY_MESSAGE):], "body"
            elif self.state == "body":
                side = "reasoning" if self.channel == "analysis" and self.recipient is None else "content"
                ends = [(i, tok) for tok in HARMONY_ENDS if (i := self.held.find(tok)) >= 0]
                if ends:
                    i, tok = min(ends)
                    out[side] += self.held[:i] + (HARMONY_CALL_END if self.recipient is not None else "")
                    self.held, self.state = self.held[i + len(tok):], "header"
                    continue
                keep = max(partial_suffix(self.held, tok) for tok in HARMONY_ENDS)
                out[side] += self.held[:len(self.held) - keep]
                self.held = self.held[len(self.held) - keep:]
                return out["reasoning"], out["content"]
            else:
                out["content"], self.held = out["content"] + self.held, ""
                return out["reasoning"], out["content"]

    def finish(self) -> tuple[str, str]:
        held, self.held = self.held, ""
        if self.state == "body":
            return (held, "") if self.channel == "analysis" and self.recipient is None else ("", held)
        return "", held if self.state in ("start", "plain") else ""


def _channel_of(header: str) -> str:
    """The channel a harmony header names: `assistant<|channel|>final`, `<|channel|>commentary to=... json`."""
    if HARMONY_CHANNEL not in header:
        return ""
    words = header.split(HARMONY_CHANNEL, 1)[1].split("<|", 1)[0].split()
    return words[0] if words else ""


def _recipient_of(header: str) -> str | None:
    """The recipient a harmony header names (`to=functions.get_weather`), or None: a message to the user."""
    found = re.search(r"\bto=([^\s<]+)", header)
    return found.group(1) if found else None


HARMONY_CALL_END = "<|call|>"


def harmony_call(recipient: str, channel: str) -> str:
    """The header a tool call's message is given out with, whatever form the model wrote it in: the one the
    GPT-OSS chat template writes earlier calls in (its body, the arguments, follows; then <|call|>)."""
    return f"<|start|>assistant to={recipient}<|channel|>{channel or 'commentary'} json<|message|>"


def is_harmony(tokenizer) -> bool:
    """A tokenizer with harmony's <|channel|> and <|message|> tokens (GPT-OSS's o200k_harmony)."""
    return tokenizer is not None and tokenizer.token_to_id(HARMONY_CHANNEL) is not None and \
        tokenizer.token_to_id(HARMONY_MESSAGE) is not None
