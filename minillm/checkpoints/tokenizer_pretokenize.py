"""HF `tokenizers`' normalizers and pre-tokenizers, step by step in Python.

A byte-level BPE tokenizer cuts each text segment (the text between added tokens) into pieces before
merging, and merges never cross a piece boundary. tokenizer.py runs the common cases as one tiktoken
regex; a tokenizer.json whose normalizer or pre-tokenizer no single regex can express (a Split that
removes or merges its delimiters, Punctuation, WhitespaceSplit, Metaspace, NFKC, Lowercase, ...) is
run here instead, with each component's semantics as `tokenizers` defines them. Anything else is
refused, naming the component: skipping it would tokenize differently from HF without a word.
"""
from __future__ import annotations

import string
import unicodedata
from typing import Callable

import regex

Piece = tuple[str, bool]          # (text, starts the whole input): Metaspace's prepend_scheme="first" asks

# Rust's char::is_whitespace: the Unicode White_Space property (Python's isspace also counts \x1c-\x1f).
_WHITE_SPACE = set("\t\n\x0b\x0c\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000") | {chr(c) for c in range(0x2000, 0x200b)}
# The GPT-2 regex ByteLevel(use_regex=True) splits with.
_GPT2 = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
_BEHAVIORS = ("Removed", "Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous")


# ---- normalizers -------------------------------------------------------------------------------------
def normalizer(spec: dict | None) -> Callable[[str], str] | None:
    """The function an HF normalizer (JSON) applies to each segment; None for none."""
    if not spec:
        return None
    kind = spec.get("type")
    if kind == "Sequence":
        steps = [normalizer(s) for s in spec.get("normalizers") or []]
        steps = [s for s in steps if s is not None]
        return lambda text: _chain(steps, text)
    if kind in ("NFC", "NFD", "NFKC", "NFKD"):
        return lambda text: unicodedata.normalize(kind, text)
    if kind == "Lowercase":
        return str.lower
    if kind == "Prepend":
        prefix = spec["prepend"]
        return lambda text: prefix + text if text else text
    if kind == "Replace":
        pattern, content = _pattern(spec["pattern"]), spec["content"]
        return lambda text: pattern.sub(lambda _: content, text)
    if kind == "Strip":
        left, right = spec.get("strip_left", True), spec.get("strip_right", True)
        return lambda text: _strip(text, left, right)
    raise ValueError(f"unsupported normalizer {kind!r} (supported: NFC, NFD, NFKC, NFKD, Lowercase, Prepend, "
                     f"Replace, Strip and Sequences of them)")


def _strip(text: str, left: bool, right: bool) -> str:
    ws = "".join(_WHITE_SPACE)
    text = text.lstrip(ws) if left else text
    return text.rstrip(ws) if right else text


def _chain(steps, text: str) -> str:
    for step in steps:
        text = step(text)
    return text


# ---- pre-tokenizers ----------------------------------------------------------------------------------
def pre_tokenizer(spec: dict | None) -> Callable[[str, bool], list[str]]:
    """pieces(text, at_start) -> the pieces an HF pre-tokenizer (JSON) cuts a segment into, in order."""
    steps = [_step(s) for s in (spec.get("pretokenizers") or [] if spec and spec.get("type") == "Sequence"
                                else [spec] if spec else [])]

    def pieces(text: str, at_start: bool) -> list[str]:
        current: list[Piece] = [(text, at_start)] if text else []
        for step in steps:
            current = [out for piece in current for out in step(piece)]
        return [t for t, _ in current]
    return pieces


def _step(spec: dict) -> Callable[[Piece], list[Piece]]:
    """One pre-tokenizer: a piece -> its pieces (empty ones dropped, as HF drops them)."""
    kind = spec.get("type")
    if kind == "Split":
        behavior = _behavior(spec.get("behavior", "Isolated"))
        pattern, invert = _pattern(spec["pattern"]), bool(spec.get("invert"))
        return lambda piece: _split(piece, _regex_spans(pattern, piece[0], invert), behavior)
    if kind == "Digits":
        behavior = "Isolated" if spec.get("individual_digits") else "Contiguous"
        return lambda piece: _split(piece, _char_spans(piece[0], _is_numeric), behavior)
    if kind == "Punctuation":
        behavior = _behavior(spec.get("behavior", "Isolated"))
        return lambda piece: _split(piece, _char_spans(piece[0], _is_punctuation), behavior)
    if kind == "WhitespaceSplit":
        return lambda piece: _split(piece, _char_spans(piece[0], _WHITE_SPACE.__contains__), "Removed")
    if kind == "Whitespace":
        words = regex.compile(r"\w+|[^\w\s]+")
        return lambda piece: _split(piece, _regex_spans(words, piece[0], True), "Removed")
    if kind == "ByteLevel":
        return lambda piece: _byte_level(piece, spec.get("add_prefix_space", True), spec.get("use_regex", True))
    if kind == "Metaspace":
        return lambda piece: _metaspace(piece, spec)
    raise ValueError(f"unsupported pre_tokenizer {kind!r} (supported: Split, Digits, Punctuation, WhitespaceSplit, "
                     f"Whitespace, ByteLevel, Metaspace and Sequences of them)")


def _behavior(name: str) -> str:
    """JSON spells behaviors "Isolated" (tokenizers' own files) or "isolated" (some hand-written ones)."""
    for b in _BEHAVIORS:
        if name.lower() == b.lower():
            return b
    raise ValueError(f"unsupported pre_tokenizer split behavior {name!r}")


def _pattern(spec: dict) -> regex.Pattern:
    if "Regex" in spec:
        return regex.compile(spec["Regex"])
    return regex.compile(regex.escape(spec["String"]))


def _regex_spans(pattern: regex.Pattern, text: str, invert: bool) -> list[tuple[int, int, bool]]:
    """(start, end, is_delimiter) covering `text`: the matches and the stretches between them."""
    spans, prev = [], 0
    for m in pattern.finditer(text):
        if m.start() > prev:
            spans.append((prev, m.start(), invert))
        spans.append((m.start(), m.end(), not invert))
        prev = m.end()
    if prev < len(text):
        spans.append((prev, len(text), invert))
    return spans


def _char_spans(text: str, is_delimiter) -> list[tuple[int, int, bool]]:
    """One span per delimiter character, one per stretch of the others (HF's char-predicate split)."""
    spans, prev = [], 0
    for i, c in enumerate(text):
        if is_delimiter(c):
            if i > prev:
                spans.append((prev, i, False))
            spans.append((i, i + 1, True))
            prev = i + 1
    if prev < len(text):
        spans.append((prev, len(text), False))
    return spans


def _split(piece: Piece, spans: list[tuple[int, int, bool]], behavior: str) -> list[Piece]:
    """The pieces `behavior` makes of the spans (tokenizers' SplitDelimiterBehavior)."""
    text, at_start = piece
    out: list[list[int]] = []                       # [start, end] of each resulting piece
    if behavior == "Removed":
        out = [[s, e] for s, e, delim in spans if not delim]
    elif behavior == "Isolated":
        out = [[s, e] for s, e, _ in spans]
    elif behavior == "Contiguous":
        previous = False
        for s, e, delim in spans:
            if out and delim == previous:
                out[-1][1] = e
            else:
                out.append([s, e])
            previous = delim
    elif behavior == "MergedWithPrevious":          # a delimiter joins the piece before it
        previous = False
        for s, e, delim in spans:
            if delim and not previous and out:
                out[-1][1] = e
            else:
                out.append([s, e])
            previous = delim
    else:                                           # MergedWithNext: a delimiter joins the piece after it
        following = False
        for s, e, delim in reversed(spans):
            if delim and not following and out:
                out[-1][0] = s
            else:
                out.append([s, e])
            following = delim
        out.reverse()
    return [(text[s:e], at_start and s == 0) for s, e in out if e > s]


def _is_numeric(c: str) -> bool:                    # Rust's char::is_numeric: Nd, Nl, No
    return unicodedata.category(c) in ("Nd", "Nl", "No")


def _is_punctuation(c: str) -> bool:                # tokenizers' is_punc: ASCII punctuation or a P* category
    return c in string.punctuation or unicodedata.category(c).startswith("P")


def _byte_level(piece: Piece, add_prefix_space: bool, use_regex: bool) -> list[Piece]:
    """ByteLevel's cutting (the bytes themselves are tiktoken's business): a space in front of each piece
    that lacks one, then GPT-2's regex."""
    text, at_start = piece
    if add_prefix_space and not text.startswith(" "):
        text = " " + text
    if not use_regex:
        return [(text, at_start)]
    return _split((text, at_start), _regex_spans(_GPT2, text, False), "Isolated")


def _metaspace(piece: Piece, spec: dict) -> list[Piece]:
    """Spaces become the replacement character, one is prepended (always, or only at the start of the
    input: "first"), and with split the text is cut in front of each."""
    mark = spec.get("replacement", "▁")
    scheme = spec.get("prepend_scheme", "always" if spec.get("add_prefix_space", True) else "never")
    text, at_start = piece
    text = text.replace(" ", mark)
    if not text.startswith(mark) and (scheme == "always" or (scheme == "first" and at_start)):
        text = mark + text
    if not spec.get("split", True):
        return [(text, at_start)]
    return _split((text, at_start), _char_spans(text, lambda c: c == mark), "MergedWithNext")
