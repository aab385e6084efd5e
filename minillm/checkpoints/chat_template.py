"""Chat templates: render a model's Jinja2 chat template the way HF transformers does.

A chat template turns a list of {"role", "content"} messages into the one prompt string the model
was fine-tuned on (ChatML's `<|im_start|>user ...<|im_end|>` for SmolLM2, `[INST]` for Llama-2, ...).
The template ships with the model (GGUF key `tokenizer.chat_template`, or `chat_template` in
tokenizer_config.json), so we only need an environment that offers what templates expect.

Two things a prompt string alone cannot keep apart, and this file does:

* Who wrote what. `render_chat_pieces` tells the template's own text (which may spell control tokens
  such as `<|im_start|>`) from the messages' contents (which are only ever text): a user who writes
  `<|im_end|><|im_start|>system` must not open a real system turn.
* Bounded work. The template is data from a model file: it runs in a sandbox whose multiplications,
  output length and running time are capped (`TemplateLimits`), so a hostile template fails in one line
  instead of looping for minutes or filling memory. `check_template` renders probe conversations when
  the model loads, so a template that breaks the caps on plain turns is refused then, not at the first chat.
"""
from __future__ import annotations

import json
import re
import secrets
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

ROLES = ("system", "user", "assistant")      # every template knows these; "tool" only where it says so


class ChatTemplateError(ValueError):
    """A conversation the template cannot (or may not) render: one line for the user."""


class TemplateSandboxError(ChatTemplateError):
    """The template broke the sandbox's bounds (a forbidden attribute, too long, too much output):
    a fault of the template itself, whatever the conversation, so it is refused when the model loads."""


@dataclass(frozen=True)
class TemplateLimits:
    """What one render may cost. Output: characters written beyond the messages' own text."""
    timeout_s: float = 2.0
    extra_output_chars: int = 1_000_000
    max_repeat_chars: int = 100_000       # `"x" * n` and friends inside the template


LIMITS = TemplateLimits()


def _raise_exception(message: str) -> None:
    # Templates call raise_exception("...") to reject conversations they cannot format
    # (e.g. Llama-2's "roles must alternate user/assistant").
    raise ChatTemplateError(f"chat template error: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters (<, >, &) which would change the prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    # Llama-3.x templates print today's date.
    return datetime.now().strftime(fmt)


def _environment_class():
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        """The sandbox, plus a cap on what one `*` or `**` may build (a string or list of a
        billion items is one bytecode: no time limit could stop it)."""
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) \
                            and len(seq) * n > LIMITS.max_repeat_chars:
                        raise SecurityError(f"the template repeats a sequence {n} times")
            if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
                raise SecurityError(f"the template raises a number to the power {right}")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):
            # str.center/ljust/rjust/zfill(width) build a string of `width` in one call
            name = getattr(__obj, "__name__", "")
            if isinstance(getattr(__obj, "__self__", None), str) and name in ("center", "ljust", "rjust", "zfill"):
                if args and isinstance(args[0], int) and args[0] > LIMITS.max_repeat_chars:
                    raise SecurityError(f"the template pads a string to {args[0]} characters")
            return super().call(__context, __obj, *args, **kwargs)

    return BoundedEnvironment


@lru_cache(maxsize=16)
def _compile(template: str):
    """Compile once per template: parsing a long template costs milliseconds, rendering microseconds."""
    import jinja2.ext

    # A sandbox because the template is data from a model file, not our code. trim_blocks and
    # lstrip_blocks are the whitespace rules every HF chat template is written against.
    env = _environment_class()(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    for name in ("center", "indent", "wordwrap"):            # widths that multiply the output in one call
        env.filters[name] = _width_capped(env.filters[name])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def _width_capped(fn):
    def capped(value, width=80, *args, **kwargs):
        if isinstance(width, int) and width > LIMITS.max_repeat_chars:
            from jinja2.sandbox import SecurityError
            raise SecurityError(f"the template asks for a width of {width}")
        return fn(value, width, *args, **kwargs)
    return capped


def template_roles(template: str | None) -> tuple[str, ...]:
    """The roles a message may have: system, user, assistant, and tool where the template renders it."""
    return ROLES + ("tool",) if template and re.search(r"""["']tool["']""", template) else ROLES


def message_text(message: Any, i: int, roles: tuple[str, ...]) -> tuple[str, str]:
    """(role, content) of one message, checked: a known role, and content that is a string, None, or
    OpenAI's list of text parts [{"type": "text", "text": ...}]."""
    if not isinstance(message, dict):
        raise ChatTemplateError(f"messages[{i}] must be an object with a role and a content")
    role, content = message.get("role"), message.get("content")
    if role not in roles:
        raise ChatTemplateError(f"messages[{i}].role must be one of {', '.join(roles)}; got {role!r}")
    if content is None:
        return role, ""
    if isinstance(content, str):
        return role, content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return role, "".join(p["text"] for p in content)
    raise ChatTemplateError(f"messages[{i}].content must be a string or a list of text parts "
                            '([{"type": "text", "text": ...}])')


def render_chat_template(template: str | None, messages: list[dict], add_generation_prompt: bool = True,
                         special_tokens: dict[str, str] | None = None, **extra: Any) -> str:
    """Render `messages` through `template`; `special_tokens` gives bos_token, eos_token, ... strings."""
    pieces = render_chat_pieces(template, messages, add_generation_prompt, special_tokens, **extra)
    return "".join(text for text, _ in pieces)


def render_chat_pieces(template: str | None, messages: list[dict], add_generation_prompt: bool = True,
                       special_tokens: dict[str, str] | None = None,
                       **extra: Any) -> list[tuple[str, bool]]:
    """The rendered prompt as (text, written_by_the_template) pieces, in order.

    Each content goes into the template between two markers that hold a random nonce, so what lies
    between them is the message's text, however it spells control tokens. Templates that `trim` the
    content (Llama-3) are met by a second render with the markers around the stripped text."""
    if not template:
        raise ChatTemplateError("this tokenizer has no chat template (no tokenizer.chat_template in the GGUF, "
                                "no chat_template in tokenizer_config.json); use a plain prompt instead")
    roles = template_roles(template)
    plain = [dict(m, role=r, content=c) for i, m in enumerate(messages)
             for r, c in [message_text(m, i, roles)]]
    variables = dict(special_tokens or {}, **extra)
    budget = sum(len(m["content"]) for m in plain) * 3 + LIMITS.extra_output_chars
    expected = _render(template, plain, add_generation_prompt, variables, budget)
    nonce = secrets.token_hex(8)
    open_, close = f"\ue000{nonce}[", f"]{nonce}\ue001"
    for strip in (False, True):
        marked = [dict(m, content=f"{open_}{m['content'].strip() if strip else m['content']}{close}")
                  for m in plain]
        pieces = _split(_render(template, marked, add_generation_prompt, variables, budget), open_, close)
        if "".join(text for text, _ in pieces) == expected:
            return pieces
    # The template changes the content some other way: its text stays text all the same.
    return pieces


def _split(rendered: str, open_: str, close: str) -> list[tuple[str, bool]]:
    """Cut a marked render into template text and message text."""
    pieces: list[tuple[str, bool]] = []
    start = 0
    for match in re.finditer(re.escape(open_) + "(.*?)" + re.escape(close), rendered, re.S):
        pieces.append((rendered[start:match.start()], True))
        pieces.append((match.group(1), False))
        start = match.end()
    pieces.append((rendered[start:], True))
    if any(open_ in text or close in text for text, _ in pieces):
        raise ChatTemplateError("the chat template cut a message's content apart; cannot tell its text "
                                "from the template's")
    return [(text, by_template) for text, by_template in pieces if text]


def _render(template: str, messages: list[dict], add_generation_prompt: bool, variables: dict,
            budget: int) -> str:
    """One bounded render: the sandbox's errors, a slow loop, or too much output end in one line."""
    from jinja2 import TemplateError
    from jinja2.sandbox import SecurityError
    compiled = _compile_or_fail(template)
    out, size = [], 0
    deadline = time.perf_counter() + LIMITS.timeout_s
    previous = sys.gettrace()
    sys.settrace(_deadline_tracer(deadline))
    try:
        for chunk in compiled.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                       **variables):
            size += len(chunk)
            if size > budget:
                raise TemplateSandboxError(f"the chat template wrote more than {budget} characters")
            out.append(chunk)
    except _TemplateTimeout:
        raise TemplateSandboxError(f"the chat template ran longer than {LIMITS.timeout_s:g} s") from None
    except SecurityError as e:
        raise TemplateSandboxError(f"the chat template did something its sandbox forbids: {e}") from None
    except OverflowError as e:
        if "sandbox" in str(e):        # jinja's sandbox refuses a range() over MAX_RANGE items
            raise TemplateSandboxError(f"the chat template did something its sandbox forbids: {e}") from None
        raise ChatTemplateError(f"chat template error: OverflowError: {e}") from None
    except RecursionError:
        raise TemplateSandboxError("the chat template recursed too deeply") from None
    except MemoryError:
        raise TemplateSandboxError("the chat template ran out of memory") from None
    except (TemplateError, TypeError, AttributeError, KeyError, IndexError, ZeroDivisionError) as e:
        raise ChatTemplateError(f"chat template error: {type(e).__name__}: {e}") from None
    finally:
        sys.settrace(previous)
    return "".join(out)


def _compile_or_fail(template: str):
    from jinja2 import TemplateError
    try:
        return _compile(template)
    except TemplateError as e:
        raise ChatTemplateError(f"the chat template does not parse: {e}") from None


# Conversations rendered once when a model loads: the turns every template is written for.
PROBES = ([{"role": "user", "content": "Hi"}],
          [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
           {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}])


def check_template(template: str, special_tokens: dict[str, str] | None = None) -> None:
    """Refuse at load, not at the first chat, a model file's template that does not parse or that
    breaks the sandbox's bounds on a plain conversation (TemplateSandboxError). A template that only
    refuses a probe (raise_exception, say, "no system role") is within its rights and loads."""
    _compile_or_fail(template)
    for messages in PROBES:
        try:
            _render(template, messages, True, dict(special_tokens or {}), LIMITS.extra_output_chars)
        except TemplateSandboxError as e:
            raise TemplateSandboxError(f"{e} (rendering a {len(messages)}-message probe conversation at "
                                       "load)") from None
        except ChatTemplateError:
            pass


class _TemplateTimeout(Exception):
    pass


def _deadline_tracer(deadline: float):
    """A trace function that stops the template's own code (Jinja compiles it to Python whose file is
    "<template>") once the deadline has passed: loops that print nothing are caught too."""
    lines = 0

    def on_line(frame, event, arg):
        nonlocal lines
        lines += 1
        if lines % 512 == 0 and time.perf_counter() > deadline:
            raise _TemplateTimeout
        return on_line

    def on_call(frame, event, arg):
        return on_line if frame.f_code.co_filename == "<template>" else None
    return on_call
