"""Chat templates: render a model's Jinja2 chat template the way HF transformers does.

A chat template turns a list of {"role", "content"} messages into the one prompt string the model
was fine-tuned on (ChatML's `<|im_start|>user ...<|im_end|>` for SmolLM2, `[INST]` for Llama-2, ...).
The template ships with the model (GGUF key `tokenizer.chat_template`, or `chat_template` in
tokenizer_config.json), so we only need an environment that offers what templates expect.

Two things a prompt string alone cannot keep apart, and this file does:

* Who wrote what. `render_chat_pieces` tells the template's own text (which may spell control tokens
  such as `<|im_start|>`) from every string the caller supplied (a message's content, name, tool calls,
  any field at any depth, and values such as tools: only ever text): a user who writes
  `<|im_end|><|im_start|>system` must not open a real system turn, whichever field carries it.
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
from contextvars import ContextVar
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
    _check_size(_text_size(value, _BUDGET.get()), "writes as JSON")
    marks = _marks_in(value)
    text = json.dumps(_plain_value(value) if marks else value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)
    # The JSON of anything the caller supplied (tools, tool-call arguments) is text, keys and all.
    return UserText(text, marks) if marks else text


def _strftime_now(fmt: str) -> str:
    # Llama-3.x templates print today's date.
    return datetime.now().strftime(fmt)


def _environment_class():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        """The sandbox, plus caps on what one operation may build: a string of a billion characters is
        one bytecode (`*`, `%`, str.replace, str.join, ...), and no time limit could stop it."""
        intercepted_binops = frozenset({"*", "**", "%"})

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                        _check_repeat(seq, n)
                if isinstance(left, int) and isinstance(right, int):
                    _check_bits(left.bit_length() + right.bit_length())
            if operator == "**" and isinstance(right, (int, float)):
                if abs(right) > 64:
                    _refuse(f"the template raises a number to the power {right}")
                if isinstance(left, int) and isinstance(right, int):
                    _check_bits(left.bit_length() * abs(right))
            if operator == "%" and isinstance(left, str):
                _check_printf(left)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):
            owner, name = getattr(__obj, "__self__", None), getattr(__obj, "__name__", "")
            if isinstance(owner, str):
                if name == "join" and args:           # one pass over the items: measure them, then join
                    args = (list(args[0]), *args[1:])
                _check_str_method(owner, name, args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

        def wrap_str_format(self, value):
            wrapped = super().wrap_str_format(value)  # "...".format(...): its widths are in the string
            if wrapped is not None:
                _check_format_widths(value.__self__)
            return wrapped

    return BoundedEnvironment


@lru_cache(maxsize=16)
def _compile(template: str):
    """Compile once per template: parsing a long template costs milliseconds, rendering microseconds."""
    import jinja2.ext

    # A sandbox because the template is data from a model file, not our code. trim_blocks and
    # lstrip_blocks are the whitespace rules every HF chat template is written against. finalize sees
    # every {{ value }} before it becomes text: a list can be small in memory and huge as text.
    env = _environment_class()(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols],
                               finalize=_finalize)
    env.filters["tojson"] = _tojson
    for name, check in _FILTER_CHECKS.items():        # filters whose output can dwarf their input
        env.filters[name] = _checked_filter(env.filters[name], check)
    del env.globals["lipsum"]                          # lipsum(n): n paragraphs in one untraceable call
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


# ---- what one call may build ----------------------------------------------------------------------------
# Each check runs before the call, from its arguments: the call itself is one bytecode, which the
# deadline cannot interrupt. A string longer than the render may write (its output budget) is refused.
_BUDGET: ContextVar[int] = ContextVar("chat_template_budget", default=LIMITS.extra_output_chars)
_PRINTF = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _refuse(message: str):
    from jinja2.sandbox import SecurityError
    raise SecurityError(message)


def _check_size(n: int, how: str) -> None:
    if n > _BUDGET.get():
        _refuse(f"the template {how} {n} characters, more than it may write")


def _check_width(n: Any) -> None:
    if n == "*" or (isinstance(n, str) and n.isdigit() and (len(n) > 9 or int(n) > LIMITS.max_repeat_chars)) \
            or (isinstance(n, int) and n > LIMITS.max_repeat_chars):
        _refuse(f"the template asks for a width of {n}")


def _check_repeat(seq: str | list | tuple, n: int) -> None:
    """`"x" * n` or `[item] * n`: at most max_repeat_chars items, and a list no longer as text than the
    render may write (a list of references to one long string is small in memory, huge as text)."""
    if len(seq) * n > LIMITS.max_repeat_chars or \
            (not isinstance(seq, str) and _text_size(seq, _BUDGET.get()) * n > _BUDGET.get()):
        _refuse(f"the template repeats a sequence {n} times")


def _check_bits(bits: int) -> None:
    """Integer * and ** build a number of about this many bits in one step."""
    if bits > 1 << 20:
        _refuse("the template computes a number of more than a million bits")


def _check_printf(fmt: str) -> None:
    """`"%09999999d" % 1`: printf widths and precisions, and no `*` (a width taken from the arguments)."""
    for width, precision in _PRINTF.findall(fmt):
        for n in (width, precision):
            _check_width(n)


def _check_format_widths(fmt: str) -> None:
    """`"{:>9999999}".format(1)`: the widths in a str.format string, and none taken from the arguments."""
    import string
    for _, _, spec, _ in string.Formatter().parse(fmt):
        if spec and "{" in spec:
            _refuse("the template takes a format width from its arguments")
        for n in re.findall(r"\d+", spec or ""):
            _check_width(n)


def _check_str_method(s: str, name: str, args: tuple, kwargs: dict) -> None:
    if name in ("center", "ljust", "rjust", "zfill") and args:
        if isinstance(args[0], int) and args[0] > LIMITS.max_repeat_chars:
            _refuse(f"the template pads a string to {args[0]} characters")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        count = args[2] if len(args) > 2 else kwargs.get("count", -1)
        _check_size(_replaced_size(s, args[0], args[1], count), "replaces into")
    elif name == "join" and args:
        _check_size(_joined_size(s, args[0]), "joins")
    elif name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(tab, int):
            _check_size(len(s) + s.count("\t") * tab, "expands tabs to")


def _replaced_size(s: str, old: str, new: str, count: Any = -1) -> int:
    n = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    return len(s) + n * (len(new) - len(old))


def _joined_size(sep: str, items: list) -> int:
    limit = _BUDGET.get()
    total = len(sep) * max(len(items) - 1, 0)
    for item in items:
        total += _text_size(item, limit)
        if total > limit:
            break
    return total


def _text_size(value: Any, limit: int) -> int:
    """About how long str(value) is, counted only until it passes `limit`: a list of a million references
    to one long string is small in memory and huge as text."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        items: Any = [*value.keys(), *value.values()]
    elif isinstance(value, (list, tuple)):
        items = value
    else:
        return 24                                      # a number, None, a bool: short
    total = 2
    for item in items:
        total += _text_size(item, limit - total) + 2
        if total > limit:
            break
    return total


def _finalize(value: Any) -> Any:
    if not isinstance(value, str):
        _check_size(_text_size(value, _BUDGET.get()), "prints")
    return value


def _checked_filter(fn, check):
    """`fn`, with `check(its arguments by name)` first (a check may replace an argument, e.g. a generator
    by the list it yields); keeps Jinja's pass_context/pass_environment mark."""
    import functools
    import inspect
    signature = inspect.signature(fn)
    # A marked filter gets Jinja's context (or eval context, or environment) first; an async-capable
    # one is marked though the function it wraps does not take it.
    passed_first = getattr(fn, "jinja_pass_arg", None) is not None
    params = list(signature.parameters.values())
    if passed_first and params and params[0].name in ("eval_ctx", "context", "environment"):
        signature = signature.replace(parameters=params[1:])

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        head, rest = (args[:1], args[1:]) if passed_first else ((), args)
        bound = signature.bind(*rest, **kwargs)
        bound.apply_defaults()
        check(bound.arguments)
        return fn(*head, *bound.args, **bound.kwargs)
    return checked


def _check_indent(a: dict) -> None:
    if isinstance(a["width"], str):                   # a string indent goes before every line
        _check_size(len(a["s"]) + (a["s"].count("\n") + 1) * len(a["width"]), "indents to")
    else:
        _check_width(a["width"])


def _check_wordwrap(a: dict) -> None:
    s, width = str(a["s"]), a["width"] if isinstance(a["width"], int) else 1
    lines = min(len(s) // max(width, 1) + s.count(" ") + s.count("\n") + 1, len(s) + 1)
    _check_size(len(s) + lines * len(a["wrapstring"] or "\n"), "wraps to")


def _check_replace(a: dict) -> None:
    if isinstance(a["s"], str) and isinstance(a["old"], str) and isinstance(a["new"], str):
        count = -1 if a["count"] is None else a["count"]
        _check_size(_replaced_size(a["s"], a["old"], a["new"], count), "replaces into")


def _check_join(a: dict) -> None:
    a["value"] = list(a["value"])                     # one pass: measured here, joined by the filter
    _check_size(_joined_size(str(a["d"]), a["value"]), "joins")


def _check_format(a: dict) -> None:
    if isinstance(a["value"], str):
        _check_printf(a["value"])


def _check_batch(a: dict) -> None:
    if a["fill_with"] is not None:                    # the last batch is padded to linecount items
        _check_width(a["linecount"])


_FILTER_CHECKS = {
    "center": lambda a: _check_width(a["width"]),
    "indent": _check_indent,
    "wordwrap": _check_wordwrap,
    "replace": _check_replace,
    "join": _check_join,
    "format": _check_format,
    "batch": _check_batch,
    "slice": lambda a: _check_width(a["slices"]),     # a Python loop over range(slices), not traced
}


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

    Every string the caller supplied (each message's keys and values but its role, at any depth, and
    the values of `extra`) goes into the template as a `UserText`: what lies between its markers is
    text, however it spells control tokens. A template that loses track of them is refused."""
    if not template:
        raise ChatTemplateError("this tokenizer has no chat template (no tokenizer.chat_template in the GGUF, "
                                "no chat_template in tokenizer_config.json); use a plain prompt instead")
    roles = template_roles(template)
    plain = [dict(m, role=r, content=c) for i, m in enumerate(messages)
             for r, c in [message_text(m, i, roles)]]
    supplied = sum(_chars(value) for m in plain for key, value in m.items() if key != "role") + _chars(extra)
    budget = supplied * 3 + LIMITS.extra_output_chars
    expected = _render(template, plain, add_generation_prompt, dict(special_tokens or {}, **extra), budget)
    marks = _new_marks()
    # The role stays plain: templates compare it, and message_text allowed only known names.
    marked = [{UserText(key, marks): value if key == "role" else _as_user_text(value, marks)
               for key, value in m.items()} for m in plain]
    variables = dict(special_tokens or {}, **{name: _as_user_text(value, marks) for name, value in extra.items()})
    try:
        # Twice the budget: the markers (18 characters a string printed) come on top of the same text.
        pieces = _split(_render(template, marked, add_generation_prompt, variables, 2 * budget), *marks)
    except TemplateSandboxError:
        raise
    except ChatTemplateError:                # a branch the plain render did not take: see below
        pieces = []
    if "".join(text for text, _ in pieces) != expected:
        # It did something to a string that UserText does not follow (a regex filter, say): the
        # caller's text can no longer be told from the template's, so nothing may be trusted.
        raise ChatTemplateError("the chat template transforms the messages' text in a way minillm cannot "
                                "follow, so it cannot keep that text apart from the template's control tokens")
    return pieces


def _new_marks() -> tuple[str, str]:
    """Two markers around a random nonce of private-use characters: no case, not a word character or
    a space, so a template that changes case or splits words leaves them as they were."""
    nonce = "".join(chr(0xE100 + b) for b in secrets.token_bytes(8))
    return f"\ue000{nonce}", f"{nonce}\ue001"


class UserText(str):
    """A string the caller supplied, in the marked render. Its characters are its text between the
    render's two markers, so every copy the template prints carries them; but it compares, hashes,
    measures, slices and transforms as its text alone, so the template takes the branches it takes
    in the plain render (`m.name == 'x'`, `tool_call_id | length`, `content.split('</think>')`)."""

    def __new__(cls, text: str, marks: tuple[str, str]):
        self = super().__new__(cls, marks[0] + text + marks[1])
        self._text, self._marks = text, marks       # _: out of the sandbox's reach
        return self

    def _again(self, value: Any) -> Any:
        """A result made of the text, marked again (strings, and the strings of lists and tuples)."""
        if isinstance(value, str):
            return UserText(value, self._marks)
        if isinstance(value, (list, tuple)):
            return type(value)(self._again(item) for item in value)
        return value

    def __hash__(self) -> int:
        return hash(self._text)

    def __iter__(self):
        return (UserText(c, self._marks) for c in self._text)

    def __repr__(self) -> str:                  # a list printed whole shows its items' repr
        return UserText(repr(self._text), self._marks)

    def __format__(self, spec: str) -> str:
        return UserText(format(self._text, spec), self._marks)


def _on_text(name: str, mark_result: bool):
    method = getattr(str, name)

    def on_text(self, *args, **kwargs):
        args = [a._text if isinstance(a, UserText) else a for a in args]
        kwargs = {k: v._text if isinstance(v, UserText) else v for k, v in kwargs.items()}
        result = method(self._text, *args, **kwargs)
        return self._again(result) if mark_result else result
    on_text.__name__ = name
    return on_text


# What a template may ask of a string is answered for its text alone; what it may make of one is made
# of its text and marked again.
for _name in ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__len__", "__contains__",
              "startswith", "endswith", "find", "rfind", "index", "rindex", "count", "isalnum", "isalpha",
              "isascii", "isdecimal", "isdigit", "isidentifier", "islower", "isnumeric", "isprintable",
              "isspace", "istitle", "isupper"):
    setattr(UserText, _name, _on_text(_name, mark_result=False))
for _name in ("__getitem__", "strip", "lstrip", "rstrip", "split", "rsplit", "splitlines", "partition",
              "rpartition", "upper", "lower", "title", "capitalize", "swapcase", "casefold", "replace",
              "center", "ljust", "rjust", "zfill", "expandtabs", "removeprefix", "removesuffix"):
    setattr(UserText, _name, _on_text(_name, mark_result=True))


def _as_user_text(value: Any, marks: tuple[str, str]) -> Any:
    """`value` with every string in it, keys included, a UserText."""
    if isinstance(value, str):
        return UserText(value, marks)
    if isinstance(value, dict):
        return {_as_user_text(k, marks): _as_user_text(v, marks) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_user_text(item, marks) for item in value]
    return value


def _chars(value: Any) -> int:
    """The characters of the strings inside `value` (a message's fields, the extra values)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_chars(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_chars(item) for item in value)
    return 0


def _marks_in(value: Any) -> tuple[str, str] | None:
    """The markers of the first UserText inside `value`, or None if it holds none."""
    if isinstance(value, UserText):
        return value._marks
    items = [*value.keys(), *value.values()] if isinstance(value, dict) else \
        value if isinstance(value, (list, tuple)) else ()
    return next((marks for item in items if (marks := _marks_in(item)) is not None), None)


def _plain_value(value: Any) -> Any:
    """`value` with every UserText in it back to its plain text."""
    if isinstance(value, UserText):
        return value._text
    if isinstance(value, dict):
        return {_plain_value(k): _plain_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_value(item) for item in value]
    return value


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
    budget_token = _BUDGET.set(budget)
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
    except ChatTemplateError:
        raise                                            # raise_exception(): the template's own words
    except (TemplateError, TypeError, ValueError, AttributeError, KeyError, IndexError, ZeroDivisionError) as e:
        raise ChatTemplateError(f"chat template error: {type(e).__name__}: {e}") from None
    finally:
        sys.settrace(previous)
        _BUDGET.reset(budget_token)
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
