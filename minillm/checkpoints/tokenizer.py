"""Tokenizer: text <-> token ids, with tiktoken's BPE core doing the merging.

Two families of BPE tokenizers cover the models minillm runs:

* byte-level BPE (GPT-2, Llama-3, SmolLM2): the text is cut into pieces by a regex, each piece's
  UTF-8 bytes are merged pairwise in the order of a merge list. Vocab strings spell bytes with
  GPT-2's byte-to-unicode alphabet (a space is "Ġ").
* SentencePiece-style BPE (Llama-2, Mistral): spaces become "▁", a "▁" is prepended to each stretch
  of text between special tokens (the dummy prefix), characters are merged by vocab score, and a
  character not in the vocab falls back to its UTF-8 bytes as <0xNN> tokens.

tiktoken merges bytes: at each step it joins the adjacent pair whose concatenation has the lowest
rank, and the rank is also the id it returns. So we give it ranks in merge-priority order and map
each rank to the real vocab id with a lookup table (vocab ids need not follow merge order).
For SentencePiece the atoms are characters, not bytes; we make every multi-byte character form first
by ranking all of its byte prefixes below every real merge (see `_spm_ranks`).
"""
from __future__ import annotations

import codecs
import json
import re
from typing import Iterable

import numpy as np
import regex
import tiktoken

from minillm.checkpoints.tokenizer_pretokenize import normalizer, pre_tokenizer
from minillm.checkpoints.chat_template import render_chat_pieces, render_chat_template

# GGUF token types (llama.cpp's enum).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
ATOMIC_TYPES = (UNKNOWN, CONTROL, USER_DEFINED)   # matched whole in the text, never merged into

SPACE_MARK = "▁"   # SentencePiece's visible space

# Pre-tokenizer regexes (what splits text into pieces before BPE).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
                  r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# GPT-2's regex run after splitting off every digit (HF: Digits(individual_digits) then ByteLevel;
# llama.cpp: "\p{N}" then the GPT-2 regex). A digit ends a piece, so the whitespace lookahead
# `(?!\S)` must also succeed in front of a digit: "a  1" is "a", "  ", "1", not "a", " ", " ", "1".
DIGITS_GPT2_PATTERN = r"""\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""

# HF pre_tokenizer JSON for each GGUF `tokenizer.ggml.pre` name we know.
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
_BYTE_LEVEL_NO_REGEX = dict(_BYTE_LEVEL, use_regex=False)
_LLAMA3_PRE = {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated", "invert": False},
    _BYTE_LEVEL_NO_REGEX]}
# SmolLM2 (StarCoder-style): the original tokenizer.json splits digits one by one before ByteLevel.
# transformers' GGUF loader drops that step (it builds a bare ByteLevel), which tokenizes "a  1"
# differently from the model's own tokenizer and from llama.cpp; we follow the original.
_DIGITS_PRE = {"type": "Sequence", "pretokenizers": [
    {"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]}
GGUF_PRE_TOKENIZERS = {
    "default": _BYTE_LEVEL, "gpt-2": _BYTE_LEVEL, "gpt2": _BYTE_LEVEL,
    "llama-bpe": _LLAMA3_PRE, "llama3": _LLAMA3_PRE, "llama-v3": _LLAMA3_PRE,
    "smollm": _DIGITS_PRE, "starcoder": _DIGITS_PRE, "refact": _DIGITS_PRE,
}

# Tokens that end a chat turn; generation stops on them as well as on eos.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "</s>", "<|endoftext|>", "<|end_of_text|>", "<|end|>",
               "<|return|>", "<|call|>")      # GPT-OSS's harmony: an answer, or a tool call, ends the turn


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable alias for each byte: printable Latin-1 bytes stand for themselves, the rest
    (control chars, space, ...) are shifted to code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shift = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shift)
            shift += 1
    return table


BYTE_TO_UNICODE = _byte_to_unicode()
UNICODE_TO_BYTE = {c: b for b, c in BYTE_TO_UNICODE.items()}


def _regex_for(pre: dict | None) -> tuple[str, bool]:
    """Translate an HF pre_tokenizer (JSON) into (tiktoken regex, add_prefix_space)."""
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre] if pre else []
    kinds = [s["type"] for s in steps]
    prefix = any(s["type"] == "ByteLevel" and s.get("add_prefix_space") for s in steps)
    digits = any(s["type"] == "Digits" and s.get("individual_digits") for s in steps)
    splits = [s for s in steps if s["type"] == "Split"]
    byte_level_regex = any(s["type"] == "ByteLevel" and s.get("use_regex", True) for s in steps)
    unknown = set(kinds) - {"ByteLevel", "Digits", "Split"}
    for s in steps:   # what the regex below does: isolate each match; one digit a piece
        if s["type"] == "Split" and (s.get("behavior", "Isolated") != "Isolated" or s.get("invert")):
            raise ValueError(f"unsupported pre_tokenizer Split behavior={s.get('behavior')!r} "
                             f"invert={s.get('invert')} (only Isolated, not inverted)")
        if s["type"] == "Digits" and not s.get("individual_digits"):
            raise ValueError("unsupported pre_tokenizer Digits with individual_digits=false")
    if prefix and (splits or digits):      # HF puts the space in front of every piece the split made
        raise ValueError("a split before ByteLevel(add_prefix_space=True) is not one regex")
    if unknown or len(splits) > 1 or (splits and (byte_level_regex or digits)) or (digits and not byte_level_regex):
        raise ValueError(f"unsupported pre_tokenizer for byte-level BPE: {json.dumps(pre)[:300]}")
    if splits:
        pattern = splits[0]["pattern"]
        # Isolated: each match is a piece and so is each stretch between matches (tiktoken keeps only
        # matches, so the stretches are spelled as a second alternative: characters where no match starts).
        split = pattern["Regex"] if "Regex" in pattern else re.escape(pattern["String"])
        return f"(?:{split})|(?:(?!(?:{split}))[\\s\\S])+", prefix
    if digits:
        return DIGITS_GPT2_PATTERN, prefix
    if byte_level_regex:
        return GPT2_PATTERN, prefix
    return r"[\s\S]+", prefix


def _alternation(strings: Iterable[str]) -> re.Pattern | None:
    """A regex matching any of `strings`, the longest where several start at one place (as HF does)."""
    strings = sorted(strings, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, strings))) if strings else None


class Tokenizer:
    """BPE tokenizer (byte-level or SentencePiece-style) for one model's vocabulary."""

    def __init__(self, *, kind: str, tokens: list[str], token_types: list[int],
                 merges: list[tuple[str, str]] | None = None, scores: list[float] | None = None,
                 pre_tokenizer: dict | None = None, add_space_prefix: bool = False,
                 bos_id: int | None = None, eos_id: int | None = None, unk_id: int | None = None,
                 add_bos: bool = False, chat_template: str | None = None, normalizer: dict | None = None,
                 metaspace: dict | None = None, normalized_ids: Iterable[int] = ()):
        if kind not in ("bpe", "spm"):
            raise ValueError(f"unknown tokenizer kind {kind!r} (expected 'bpe' or 'spm')")
        self.kind = kind                    # "bpe": byte-level BPE; "spm": SentencePiece-style BPE
        self.tokens = list(tokens)
        self.token_types = list(token_types)
        self.merges = merges                # byte-level merge list, kept to save it back unchanged
        self.scores = scores                # SentencePiece scores (merge priority), when known
        self.pre_tokenizer = pre_tokenizer  # HF pre_tokenizer JSON (byte-level only)
        self.normalizer = normalizer        # HF normalizer JSON (byte-level, or with `metaspace`)
        self.metaspace = metaspace          # SentencePiece-style from an HF tokenizer.json: its Metaspace step
        # Added tokens HF matches in the normalized text, spelled as normalized (tokenizer.json's
        # "normalized": true, user-defined ones); the rest are cut out of the raw text first.
        self.normalized_ids = frozenset(normalized_ids)
        self.add_space_prefix = add_space_prefix
        self.bos_id, self.eos_id, self.unk_id = bos_id, eos_id, unk_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.vocab_size = len(self.tokens)
        self._ids = {t: i for i, t in enumerate(self.tokens)}
        self.special_tokens = {t: i for i, t in enumerate(self.tokens) if self.token_types[i] in ATOMIC_TYPES}
        self.eos_ids = self._end_ids()
        self._bytes = [self._token_bytes(i) for i in range(self.vocab_size)]
        self._build_encoder()

    # ---- construction -----------------------------------------------------------------------

    def _token_bytes(self, i: int) -> bytes:
        """The bytes token i stands for when decoding."""
        tok, kind = self.tokens[i], self.token_types[i]
        if kind in ATOMIC_TYPES:
            return tok.encode("utf-8")
        if self.kind == "spm":
            if kind == BYTE:
                return bytes([int(tok[3:5], 16)])
            return tok.replace(SPACE_MARK, " ").encode("utf-8")
        if all(c in UNICODE_TO_BYTE for c in tok):
            return bytes(UNICODE_TO_BYTE[c] for c in tok)
        return tok.encode("utf-8")      # a stray token outside GPT-2's alphabet: take it literally

    def _end_ids(self) -> list[int]:
        ids = [] if self.eos_id is None else [self.eos_id]
        harmony = "<|channel|>" in self._ids        # GPT-OSS: <|end|> ends one message, the turn goes on
        for name in END_OF_TURN:
            if harmony and name == "<|end|>":
                continue
            i = self._ids.get(name)
            if i is not None and i not in ids and self.token_types[i] in (CONTROL, USER_DEFINED):
                ids.append(i)
        return ids

    def _priority(self) -> list[int]:
        """Ids of the mergeable tokens, highest merge priority first."""
        if self.merges is not None:
            order, seen = [], set()
            for left, right in self.merges:
                i = self._ids.get(left + right)
                if i is not None and i not in seen and self.token_types[i] == NORMAL:
                    seen.add(i)
                    order.append(i)
            return order
        if self.scores is None:
            raise ValueError("a BPE vocabulary needs merges or scores")
        normal = [i for i in range(self.vocab_size) if self.token_types[i] == NORMAL]
        # Higher score merges first; equal scores (Llama-2's runs of "▁") fall back to id order.
        return sorted(normal, key=lambda i: (-self.scores[i], i))

    def _build_encoder(self) -> None:
        self._missing_bytes = b""                  # byte-level: bytes with no vocab token (filled below)
        ranks, rank_ids = (self._bpe_ranks() if self.kind == "bpe" else self._spm_ranks())
        # rank -> vocab id; -1 marks ranks that map to another number of ids than one
        # (SentencePiece's partial characters expand to byte tokens; a missing byte maps to none).
        table = np.full(len(rank_ids), -1, dtype=np.int64)
        self._expand: dict[int, list[int]] = {}
        for rank, ids in enumerate(rank_ids):
            if len(ids) == 1:
                table[rank] = ids[0]
            else:
                self._expand[rank] = ids
        self._rank_to_id = table
        self._pieces, self._normalize = None, normalizer(self.normalizer)
        if self.kind == "spm" and self.metaspace is not None:   # HF Metaspace: its prepend and split rules
            self._pieces = pre_tokenizer(self.metaspace)
        if self.kind == "bpe":
            try:
                pattern, self._prefix_space = _regex_for(self.pre_tokenizer)
            except ValueError:      # no one regex says it: HF's steps one by one (tokenizer_pretokenize)
                self._pieces = pre_tokenizer(self.pre_tokenizer)
                pattern, self._prefix_space = r"[\s\S]+", False
        else:
            pattern, self._prefix_space = r"[\s\S]+", False   # SentencePiece sees the text whole
        self._enc = tiktoken.Encoding(f"minillm-{self.kind}", pat_str=pattern,
                                      mergeable_ranks=ranks, special_tokens={})
        raw = [t for t in self.special_tokens if self._ids[t] not in self.normalized_ids]
        self._atomic_all = _alternation(raw)
        self._atomic_user = _alternation([t for t in raw if self.token_types[self._ids[t]] == USER_DEFINED])
        self._after_normalizer = {self._normalized(self.tokens[i]): i for i in sorted(self.normalized_ids)}
        self._after_normalizer.pop("", None)
        self._after_normalizer_pattern = _alternation(list(self._after_normalizer))

    def _bpe_ranks(self) -> tuple[dict[bytes, int], list[list[int]]]:
        """Byte-level: the 256 bytes first, then each merge result in merge order."""
        ranks: dict[bytes, int] = {}
        rank_ids: list[list[int]] = []
        for b in range(256):
            # A byte missing from the vocab (SmolLM2 lacks 0x04, 0xf5..0xff, ...) is dropped, as HF's
            # BPE without an unk token does: it maps to no ids.
            i = self._ids.get(BYTE_TO_UNICODE[b])
            ranks[bytes([b])] = b
            rank_ids.append([i] if i is not None else [])
            if i is None:
                self._missing_bytes += bytes([b])
        for i in self._priority():
            piece = self._bytes[i]
            if len(piece) > 1 and piece not in ranks:
                ranks[piece] = len(rank_ids)
                rank_ids.append([i])
        return ranks, rank_ids

    def _spm_ranks(self) -> tuple[dict[bytes, int], list[list[int]]]:
        """SentencePiece: bytes, then every partial/whole character, then merges by priority.

        SentencePiece never splits a character, so all byte prefixes of every character that occurs
        in the vocab rank below all real merges: characters assemble before any merge across them.
        A prefix or character that is not itself a token and survives to the end expands to its
        <0xNN> byte-fallback tokens.
        """
        byte_ids = {self._bytes[i][0]: i for i in range(self.vocab_size) if self.token_types[i] == BYTE}

        def fallback(data: bytes) -> list[int]:
            if not all(b in byte_ids for b in data):
                raise ValueError(f"SentencePiece vocabulary lacks byte-fallback tokens for {data!r}")
            return [byte_ids[b] for b in data]

        ranks: dict[bytes, int] = {}
        rank_ids: list[list[int]] = []

        def add(piece: bytes, ids: list[int]) -> None:
            if piece not in ranks:
                ranks[piece] = len(rank_ids)
                rank_ids.append(ids)

        normal = [i for i in range(self.vocab_size) if self.token_types[i] == NORMAL]
        single = {self.tokens[i]: i for i in normal if len(self.tokens[i]) == 1}
        for b in range(256):
            i = single.get(chr(b)) if b < 0x80 else None
            add(bytes([b]), [i] if i is not None else fallback(bytes([b])))
        for c in sorted({c for i in normal for c in self.tokens[i]}):
            data = c.encode("utf-8")
            for end in range(2, len(data) + 1):
                i = single.get(c) if end == len(data) else None
                add(data[:end], [i] if i is not None else fallback(data[:end]))
        for i in self._priority():
            if len(self.tokens[i]) > 1:
                add(self.tokens[i].encode("utf-8"), [i])
        return ranks, rank_ids

    # ---- encoding -----------------------------------------------------------------------------

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids for `text`, never with BOS. With allow_special, control tokens written in the text
        (e.g. "<|im_start|>") become their single ids; otherwise they are spelled out as plain text."""
        pattern = self._atomic_all if allow_special else self._atomic_user
        if pattern is None:
            return self._encode_plain(text, 0)
        ids: list[int] = []
        start = 0
        for match in pattern.finditer(text):
            if match.start() > start:
                ids += self._encode_plain(text[start:match.start()], start)
            ids.append(self.special_tokens[match.group()])
            start = match.end()
        if start < len(text):
            ids += self._encode_plain(text[start:], start)
        return ids

    def _encode_plain(self, text: str, offset: int) -> list[int]:
        """BPE on one segment of the input between added tokens; `offset` is where it starts in the input.
        Like HF, each segment is normalized on its own, then split on the added tokens matched after that."""
        if not text:
            return []
        text = self._normalized(text)
        if self._after_normalizer_pattern is None:
            return self._encode_normalized(text, offset == 0)
        ids, start = [], 0
        for match in self._after_normalizer_pattern.finditer(text):
            ids += self._encode_normalized(text[start:match.start()], offset == 0 and start == 0)
            ids.append(self._after_normalizer[match.group()])
            start = match.end()
        return ids + self._encode_normalized(text[start:], offset == 0 and start == 0)

    def _normalized(self, text: str) -> str:
        """A segment as the normalizer leaves it. SentencePiece without a Metaspace step (a GGUF, or a
        tokenizer.json's Prepend + Replace normalizer): spaces become "▁" and, with the dummy prefix, a
        "▁" leads every segment, the one after a special token too (llama.cpp and HF both do so)."""
        if self.kind == "spm" and self.metaspace is None:
            return (SPACE_MARK if self.add_space_prefix and text else "") + text.replace(" ", SPACE_MARK)
        return self._normalize(text) if self._normalize is not None else text

    def _encode_normalized(self, text: str, at_start: bool) -> list[int]:
        """BPE on normalized text holding no added token; `at_start`: it begins the whole input (HF's
        Metaspace prepend_scheme="first" asks)."""
        if not text:
            return []
        if self._pieces is not None:               # HF's pre-tokenizer, step by step (Metaspace, ...)
            encode_piece = self._enc.encode_ordinary if self.kind == "spm" else self._piece_ranks
            return self._ids_of([r for piece in self._pieces(text, at_start) for r in encode_piece(piece)])
        if self.kind == "spm":
            return self._ids_of(self._enc.encode_ordinary(text))
        if self._prefix_space and not text.startswith(" "):
            text = " " + text                      # HF ByteLevel(add_prefix_space=True), per segment
        return self._ids_of(self._byte_level_ranks(text))

    def _ids_of(self, ranks: list[int]) -> list[int]:
        """Vocab ids of tiktoken's ranks (a SentencePiece partial character expands to its byte tokens)."""
        ids = self._rank_to_id[ranks]
        if not self._expand or ids.min(initial=0) >= 0:
            return ids.tolist()
        out: list[int] = []
        for rank, i in zip(ranks, ids.tolist()):
            out += self._expand[rank] if i < 0 else [i]
        return out

    def _piece_ranks(self, piece: str) -> list[int]:
        """BPE within one piece (bytes the vocabulary lacks dropped first, as in _byte_level_ranks)."""
        kept = piece.encode("utf-8").translate(None, self._missing_bytes)
        return self._enc._encode_single_piece(kept) if kept else []

    def _byte_level_ranks(self, text: str) -> list[int]:
        """tiktoken's split + BPE, except around bytes the vocabulary lacks (SmolLM2 has no token for
        0x04, 0xf5..0xff, ...): HF drops such a byte from its piece *before* merging, so its
        neighbours may merge across the gap ("+\x16=" is the single token "+="); do the same."""
        missing = self._missing_bytes
        if not missing or len(text.encode("utf-8").translate(None, missing)) == len(text.encode("utf-8")):
            return self._enc.encode_ordinary(text)
        ranks: list[int] = []
        for piece in regex.findall(self._enc._pat_str, text):
            kept = piece.encode("utf-8").translate(None, missing)
            if kept:
                ranks += self._enc._encode_single_piece(kept)
        return ranks

    # ---- decoding -----------------------------------------------------------------------------

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The raw bytes of `ids` (no leading-space handling)."""
        table = self._bytes
        return b"".join(table[i] for i in ids)

    def decode(self, ids: Iterable[int]) -> str:
        """Text for `ids`; invalid UTF-8 becomes U+FFFD. SentencePiece drops one leading space, as HF does."""
        text = self.decode_bytes(ids).decode("utf-8", errors="replace")
        if self.kind == "spm" and self.add_space_prefix and text.startswith(" "):
            text = text[1:]
        return text

    def stream_decoder(self) -> "StreamDecoder":
        """A decoder that turns ids into text one at a time, holding back split UTF-8 characters."""
        return StreamDecoder(self)

    def token_to_id(self, s: str) -> int | None:
        """Id of the vocab string `s` (as spelled in the vocab, e.g. "Ġthe" or "▁the"), or None."""
        return self._ids.get(s)

    def id_to_token(self, i: int) -> str:
        """The vocab string of id `i`."""
        return self.tokens[i]

    # ---- chat -----------------------------------------------------------------------------------

    def template_tokens(self) -> dict[str, str]:
        """The special tokens a chat template may print: bos_token, eos_token, unk_token."""
        names = {"bos_token": self.bos_id, "eos_token": self.eos_id, "unk_token": self.unk_id}
        return {k: self.tokens[i] for k, i in names.items() if i is not None}

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """The prompt string for `messages`, rendered with the model's own chat template."""
        return render_chat_template(self.chat_template, messages, add_generation_prompt, self.template_tokens(),
                                    **extra)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> list[int]:
        """The prompt ids for `messages`: what the template writes may be control tokens, what the
        messages say is only text (a content that spells "<|im_start|>" cannot open a turn)."""
        pieces = render_chat_pieces(self.chat_template, messages, add_generation_prompt, self.template_tokens(),
                                    **extra)
        # Text between two control tokens is one BPE run, as if the prompt were encoded whole: a
        # message's text joins the template text around it; only the control tokens differ.
        ids: list[int] = []
        run, run_start, offset = [], 0, 0
        for text, by_template in pieces:
            pattern = self._atomic_all if by_template else self._atomic_user
            start = 0
            for match in pattern.finditer(text) if pattern is not None else ():
                run.append(text[start:match.start()])
                ids += self._encode_plain("".join(run), run_start)
                ids.append(self.special_tokens[match.group()])
                run, run_start, start = [], offset + match.end(), match.end()
            run.append(text[start:])
            offset += len(text)
        return ids + self._encode_plain("".join(run), run_start)

    def min_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)), in one pass over the bytes: no token is longer than the
        longest in the vocabulary. It refuses a prompt far over the context before any BPE runs."""
        if self._pieces is not None or self._normalize is not None:
            return 0                         # a normalizer or a Removed split may shrink the text: no bound
        if getattr(self, "_longest", None) is None:
            self._longest = max(len(b) for b in self._bytes) or 1
        longest = self._longest
        n_bytes, step = 0, 1 << 19           # in slices: no single call holds the GIL for long
        for start in range(0, len(text), step):
            data = text[start:start + step].encode("utf-8", errors="surrogatepass")
            if self.kind == "bpe" and self._missing_bytes:
                data = data.translate(None, self._missing_bytes)     # bytes without a token add none
            n_bytes += len(data)
        return -(-n_bytes // longest)

    def __repr__(self) -> str:
        return (f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
                f"eos_ids={self.eos_ids}, add_bos={self.add_bos})")


class StreamDecoder:
    """Incremental decode: push ids one by one, get the text they complete.

    A character split across tokens (an emoji as four <0xNN> byte tokens) is held back until its last
    byte arrives. The pieces concatenate to exactly `tokenizer.decode(all_ids)`.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._strip_space = tokenizer.kind == "spm" and tokenizer.add_space_prefix
        self._started = False

    def push(self, token_id: int) -> str:
        """Add one id; return the newly completed text (may be "")."""
        return self._emit(self._utf8.decode(self._tok._bytes[token_id]))

    def flush(self) -> str:
        """End of stream: return what is left (an unfinished character becomes U+FFFD)."""
        return self._emit(self._utf8.decode(b"", final=True))

    def _emit(self, text: str) -> str:
        if text and not self._started:
            self._started = True
            if self._strip_space and text.startswith(" "):
                text = text[1:]      # the dummy-prefix space, as decode() drops it
        return text
