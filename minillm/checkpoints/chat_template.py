"""Chat templates: render a model's Jinja2 chat template the way HF transformers does.

A chat template turns a list of {"role", "content"} messages into the one prompt string the model
was fine-tuned on (ChatML's `<|im_start|>user ...<|im_end|>` for SmolLM2, `[INST]` for Llama-2, ...).
The template ships with the model (GGUF key `tokenizer.chat_template`, or `chat_template` in
tokenizer_config.json), so we only need an environment that offers what templates expect.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any


def _raise_exception(message: str) -> None:
    # Templates call raise_exception("...") to reject conversations they cannot format
    # (e.g. Llama-2's "roles must alternate user/assistant").
    raise ValueError(f"chat template error: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters (<, >, &) which would change the prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    # Llama-3.x templates print today's date.
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(template: str):
    """Compile once per template: parsing a long template costs milliseconds, rendering microseconds."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # A sandbox because the template is data from a model file, not our code. trim_blocks and
    # lstrip_blocks are the whitespace rules every HF chat template is written against.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat_template(template: str | None, messages: list[dict], add_generation_prompt: bool = True,
                         special_tokens: dict[str, str] | None = None, **extra: Any) -> str:
    """Render `messages` through `template`; `special_tokens` gives bos_token, eos_token, ... strings."""
    if not template:
        raise ValueError("this tokenizer has no chat template (no tokenizer.chat_template in the GGUF, "
                         "no chat_template in tokenizer_config.json); use a plain prompt instead")
    variables = dict(special_tokens or {})
    variables.update(extra)
    return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **variables)
