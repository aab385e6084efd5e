"""Tokenizer: text <-> token ids, with tiktoken's BPE core doing the merging.

Two families of BPE tokenizers cover the models minillm runs:

* byte-level BPE (GPT-2, Llama-3, SmolLM2): the text is cut into pieces by a regex, each piece's
  UTF-8 bytes are merged pairwise in the order of a merge list. Vocab strings spell bytes with
  GPT-2's byte-to-unicode alphabet (a space is "Ġ").
* SentencePiece-style BPE (Llama-2, Mistral): spaces become "▁", a "▁" is prepended to the text
  (the dummy prefix), characters are merged by vocab score, and a character not in the vocab falls
  back to its UTF-8 bytes as <0xNN> tokens.

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
from pathlib import Path
from typing import Iterable

import numpy as np
import tiktoken

from minillm.chat_template import render_chat_template

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
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "</s>", "<|endoftext|>", "<|end_of_text|>", "<|end|>")


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
    if unknown or len(splits) > 1 or (splits and (byte_level_regex or digits)) or (digits and not byte_level_regex):
        raise ValueError(f"unsupported pre_tokenizer for byte-level BPE: {json.dumps(pre)[:300]}")
    if splits:
        pattern = splits[0]["pattern"]
        if "Regex" in pattern:
            return pattern["Regex"], prefix
        return re.escape(pattern["String"]) + r"|(?:(?!" + re.escape(pattern["String"]) + r")[\s\S])+", prefix
    if digits:
        return DIGITS_GPT2_PATTERN, prefix
    if byte_level_regex:
        return GPT2_PATTERN, prefix
    return r"[\s\S]+", prefix


class Tokenizer:
    """BPE tokenizer (byte-level or SentencePiece-style) for one model's vocabulary."""

    def __init__(self, *, kind: str, tokens: list[str], token_types: list[int],
                 merges: list[tuple[str, str]] | None = None, scores: list[float] | None = None,
                 pre_tokenizer: dict | None = None, add_space_prefix: bool = False,
                 bos_id: int | None = None, eos_id: int | None = None, unk_id: int | None = None,
                 add_bos: bool = False, chat_template: str | None = None):
        if kind not in ("bpe", "spm"):
            raise ValueError(f"unknown tokenizer kind {kind!r} (expected 'bpe' or 'spm')")
        self.kind = kind                    # "bpe": byte-level BPE; "spm": SentencePiece-style BPE
        self.tokens = list(tokens)
        self.token_types = list(token_types)
        self.merges = merges                # byte-level merge list, kept to save it back unchanged
        self.scores = scores                # SentencePiece scores (merge priority), when known
        self.pre_tokenizer = pre_tokenizer  # HF pre_tokenizer JSON (byte-level only)
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
        for name in END_OF_TURN:
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
        if self.kind == "bpe":
            pattern, self._prefix_space = _regex_for(self.pre_tokenizer)
        else:
            pattern, self._prefix_space = r"[\s\S]+", False   # SentencePiece sees the text whole
        self._enc = tiktoken.Encoding(f"minillm-{self.kind}", pat_str=pattern,
                                      mergeable_ranks=ranks, special_tokens={})
        atomic = sorted(self.special_tokens, key=len, reverse=True)   # longest match wins, like HF
        user = [t for t in atomic if self.token_types[self._ids[t]] == USER_DEFINED]
        self._atomic_all = re.compile("|".join(map(re.escape, atomic))) if atomic else None
        self._atomic_user = re.compile("|".join(map(re.escape, user))) if user else None

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
        """BPE on text that holds no special tokens; `offset` is where it starts in the full input."""
        if not text:
            return []
        if self.kind == "spm":
            text = text.replace(" ", SPACE_MARK)
            # Dummy prefix only at the start of the input (HF Metaspace prepend_scheme="first").
            if self.add_space_prefix and offset == 0:
                text = SPACE_MARK + text
        elif self._prefix_space and not text.startswith(" "):
            text = " " + text                      # HF ByteLevel(add_prefix_space=True), per segment
        ranks = self._enc.encode_ordinary(text)
        ids = self._rank_to_id[ranks]
        if not self._expand or ids.min(initial=0) >= 0:
            return ids.tolist()
        out: list[int] = []
        for rank, i in zip(ranks, ids.tolist()):
            out += self._expand[rank] if i < 0 else [i]
        return out

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

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """The prompt string for `messages`, rendered with the model's own chat template."""
        names = {"bos_token": self.bos_id, "eos_token": self.eos_id, "unk_token": self.unk_id}
        strings = {k: self.tokens[i] for k, i in names.items() if i is not None}
        return render_chat_template(self.chat_template, messages, add_generation_prompt, strings, **extra)

    def __repr__(self) -> str:
        return (f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
                f"eos_ids={self.eos_ids}, add_bos={self.add_bos})")

    # ---- loading and saving ---------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path_or_reader) -> "Tokenizer":
        """Load the tokenizer stored in a GGUF file (a model file or a vocab-only one)."""
        return cls(**_args_from_gguf(path_or_reader))

    @classmethod
    def from_dir(cls, path) -> "Tokenizer":
        """Load an HF tokenizer: a folder with tokenizer.json (+ tokenizer_config.json) or the json itself."""
        return cls(**_args_from_hf(path))

    def save(self, directory) -> None:
        """Write tokenizer.json and tokenizer_config.json (HF format) into `directory`."""
        _save_hf(self, Path(directory))


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


def load_tokenizer(path) -> Tokenizer:
    """Load a tokenizer from a .gguf file (vocab-only is fine), a folder, or a tokenizer.json."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no tokenizer at {path}: expected a .gguf file, a tokenizer.json, "
                                "or a folder holding tokenizer.json")
    if path.is_dir():
        if (path / "tokenizer.json").exists():
            return Tokenizer.from_dir(path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return Tokenizer.from_gguf(ggufs[0])
        raise ValueError(f"{path} holds no tokenizer.json (and not exactly one .gguf file)")
    if _is_gguf(path):
        return Tokenizer.from_gguf(path)
    if path.suffix == ".json":
        return Tokenizer.from_dir(path)
    raise ValueError(f"{path} is not a tokenizer file: expected a GGUF file or an HF tokenizer.json")


# ---- file formats: GGUF in, HF tokenizer.json in and out --------------------------------------

LLAMA3_PRE_NAMES = ("llama-bpe", "llama3", "llama-v3")


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


# GGUF metadata value types: struct format of each scalar type; 8 is a string, 9 an array.
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                 10: "<Q", 11: "<q", 12: "<d"}


def _read_gguf_metadata(path: Path) -> dict:
    """The key/value metadata at the head of a GGUF file, without touching the tensors.

    gguf.GGUFReader builds numpy views for every string of the vocab and merges (13 s for Llama-3's
    128K tokens + 280K merges); walking the bytes directly takes well under a second.
    """
    import mmap
    import struct
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (it does not start with the GGUF magic)")
        version, _n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is too old (need 2 or later)")
        pos = 24

        def string() -> str:
            nonlocal pos
            (n,) = struct.unpack_from("<Q", buf, pos)
            pos += 8 + n
            return buf[pos - n:pos].decode("utf-8", errors="replace")

        def value(kind: int):
            nonlocal pos
            if kind == 8:
                return string()
            if kind == 9:
                elem, n = struct.unpack_from("<IQ", buf, pos)
                pos += 12
                if elem in _GGUF_SCALARS and elem != 7:   # numbers: one bulk read
                    dtype = np.dtype(_GGUF_SCALARS[elem])
                    arr = np.frombuffer(buf, dtype=dtype, count=n, offset=pos)
                    pos += n * dtype.itemsize
                    return arr.tolist()
                return [value(elem) for _ in range(n)]
            fmt = _GGUF_SCALARS[kind]
            (v,) = struct.unpack_from(fmt, buf, pos)
            pos += struct.calcsize(fmt)
            return v

        meta = {}
        for _ in range(n_kv):
            key = string()
            (kind,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            meta[key] = value(kind)
        return meta


def _args_from_gguf(path_or_reader) -> dict:
    """Constructor arguments from a GGUF file's tokenizer.* metadata."""
    import gguf
    if isinstance(path_or_reader, gguf.GGUFReader):
        reader, where = path_or_reader, "GGUF file"
        meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    else:
        path = Path(path_or_reader)
        if not path.exists():
            raise FileNotFoundError(f"no GGUF file at {path}")
        if path.is_dir() or not _is_gguf(path):
            raise ValueError(f"{path} is not a GGUF file (it does not start with the GGUF magic)")
        meta, where = _read_gguf_metadata(path), str(path)

    def get(key: str, default=None):
        return meta.get(f"tokenizer.{key}", default)

    model = get("ggml.model")
    if model is None:
        raise ValueError(f"{where} holds no tokenizer (no tokenizer.ggml.model key)")
    tokens = get("ggml.tokens")
    args = dict(tokens=tokens, token_types=get("ggml.token_type") or [NORMAL] * len(tokens),
                bos_id=get("ggml.bos_token_id"), eos_id=get("ggml.eos_token_id"),
                unk_id=get("ggml.unknown_token_id"), chat_template=get("chat_template"))
    add_bos = get("ggml.add_bos_token")
    if model == "gpt2":
        pre = get("ggml.pre", "default")
        if pre not in GGUF_PRE_TOKENIZERS:
            raise ValueError(f"{where}: unsupported pre-tokenizer {pre!r} "
                             f"(supported: {', '.join(sorted(GGUF_PRE_TOKENIZERS))})")
        merges = [tuple(m.split(" ")) for m in get("ggml.merges")]
        args.update(kind="bpe", merges=merges, pre_tokenizer=GGUF_PRE_TOKENIZERS[pre])
        # add_bos: the file's own flag when present (SmolLM2 says False, and HF transformers loading
        # that GGUF adds no BOS either). Without the flag, Llama-3 prepends <|begin_of_text|> (its HF
        # post-processor does) and GPT-2 style vocabularies add nothing.
        args["add_bos"] = add_bos if add_bos is not None else pre in LLAMA3_PRE_NAMES
    elif model == "llama":
        # SentencePiece defaults: dummy prefix on, BOS on (Llama-2, Mistral, TinyLlama).
        args.update(kind="spm", scores=get("ggml.scores"),
                    add_space_prefix=get("ggml.add_space_prefix", True),
                    add_bos=add_bos if add_bos is not None else True)
    else:
        raise ValueError(f"{where}: unsupported tokenizer model {model!r} (supported: 'gpt2', 'llama')")
    return args


def _token_string(value) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def _is_spm_json(data: dict) -> bool:
    model, text = data["model"], json.dumps([data.get("normalizer"), data.get("pre_tokenizer"),
                                             data.get("decoder")])
    return bool(model.get("byte_fallback")) or "Metaspace" in text or SPACE_MARK in text


def _spm_prefix_from_json(data: dict) -> bool:
    """Whether an HF SentencePiece-style tokenizer prepends the dummy "▁"."""
    text = json.dumps([data.get("normalizer"), data.get("pre_tokenizer")])
    pre = data.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre])
    for step in steps:
        if step.get("type") == "Metaspace":
            scheme = step.get("prepend_scheme", "always" if step.get("add_prefix_space", True) else "never")
            return scheme != "never"
    return '"Prepend"' in text


def _args_from_hf(path) -> dict:
    """Constructor arguments from an HF tokenizer.json (+ tokenizer_config.json beside it)."""
    path = Path(path)
    json_path = path / "tokenizer.json" if path.is_dir() else path
    if not json_path.exists():
        raise FileNotFoundError(f"no tokenizer.json at {json_path}")
    try:
        data = json.loads(json_path.read_text(encoding="utf-8"))
        model = data["model"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{json_path} is not an HF tokenizer.json ({err})") from None
    if model.get("type") != "BPE":
        raise ValueError(f"{json_path}: only BPE tokenizers are supported, not {model.get('type')!r}")
    config_path = json_path.parent / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}

    vocab: dict[str, int] = model["vocab"]
    added = data.get("added_tokens") or []
    size = 1 + max([*vocab.values(), *(a["id"] for a in added)])
    tokens = [f"<unused_{i}>" for i in range(size)]   # holes in the id range stay unusable
    types = [UNUSED] * size
    spm = _is_spm_json(data)
    for tok, i in vocab.items():
        tokens[i] = tok
        is_byte = spm and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", tok) is not None
        types[i] = BYTE if is_byte else NORMAL
    for a in added:
        tokens[a["id"]] = a["content"]
        types[a["id"]] = CONTROL if a.get("special") else USER_DEFINED
    ids = {t: i for i, t in enumerate(tokens)}
    unk_id = ids.get(model.get("unk_token")) if model.get("unk_token") else None
    if unk_id is not None:
        types[unk_id] = UNKNOWN

    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
    bos = _token_string(config.get("bos_token"))
    eos = _token_string(config.get("eos_token"))
    args = dict(kind="spm" if spm else "bpe", tokens=tokens, token_types=types, merges=merges,
                bos_id=ids.get(bos), eos_id=ids.get(eos), unk_id=unk_id,
                chat_template=_chat_template_from(config, json_path.parent))
    if spm:
        args["add_space_prefix"] = _spm_prefix_from_json(data)
    else:
        args["pre_tokenizer"] = data.get("pre_tokenizer")
        if data.get("normalizer"):
            raise ValueError(f"{json_path}: byte-level tokenizers with a normalizer are not supported")
    add_bos = config.get("add_bos_token")
    if add_bos is None:      # no flag: does the post-processor put BOS in front of a sequence?
        single = (data.get("post_processor") or {}).get("single") or [{}]
        add_bos = bos is not None and single[0].get("SpecialToken", {}).get("id") == bos
    args["add_bos"] = bool(add_bos)
    return args


def _chat_template_from(config: dict, folder: Path) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):      # named templates: [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default", next(iter(named.values()), None))
    if template is None and (folder / "chat_template.jinja").exists():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    return template


def _spm_merges(tok: Tokenizer) -> list[tuple[str, str]]:
    """HF needs explicit merges: every split of each token into two vocab tokens, in priority order."""
    def mergeable(piece: str) -> bool:
        i = tok._ids.get(piece)
        return i is not None and tok.token_types[i] == NORMAL

    merges = []
    for i in tok._priority():
        piece = tok.tokens[i]
        merges += [(piece[:cut], piece[cut:]) for cut in range(1, len(piece))
                   if mergeable(piece[:cut]) and mergeable(piece[cut:])]
    return merges


def _hf_json(tok: Tokenizer) -> dict:
    """The tokenizer.json document for `tok`."""
    added = [{"id": i, "content": tok.tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": tok.token_types[i] != USER_DEFINED}
             for i in sorted(tok.special_tokens.values())]
    bos = tok.tokens[tok.bos_id] if tok.bos_id is not None else None
    post = None
    if tok.add_bos and bos is not None:
        post = {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {bos: {"id": bos, "ids": [tok.bos_id], "tokens": [bos]}}}
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
             "vocab": {t: i for i, t in enumerate(tok.tokens)}}
    if tok.kind == "bpe":
        model["merges"] = [list(m) for m in tok.merges or []]
        pre, normalizer = tok.pre_tokenizer, None
        decoder = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    else:
        model.update(merges=[list(m) for m in _spm_merges(tok)], fuse_unk=True, byte_fallback=True,
                     unk_token=tok.tokens[tok.unk_id] if tok.unk_id is not None else None)
        # Normalizer rather than a Metaspace pre-tokenizer: Metaspace skips the dummy prefix when
        # the text already starts with a space, unlike SentencePiece (" Hello" -> "▁▁Hello").
        replace = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE_MARK}
        prepend = [{"type": "Prepend", "prepend": SPACE_MARK}] if tok.add_space_prefix else []
        pre, normalizer = None, {"type": "Sequence", "normalizers": [*prepend, replace]}
        steps = [{"type": "Replace", "pattern": {"String": SPACE_MARK}, "content": " "},
                 {"type": "ByteFallback"}, {"type": "Fuse"}]
        if tok.add_space_prefix:
            steps.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
        decoder = {"type": "Sequence", "decoders": steps}
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": normalizer, "pre_tokenizer": pre, "post_processor": post, "decoder": decoder,
            "model": model}


def _save_hf(tok: Tokenizer, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    name = lambda i: tok.tokens[i] if i is not None else None  # noqa: E731
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": tok.add_bos,
              "add_eos_token": False, "bos_token": name(tok.bos_id), "eos_token": name(tok.eos_id),
              "unk_token": name(tok.unk_id), "clean_up_tokenization_spaces": False,
              "model_max_length": 1 << 30}
    if tok.chat_template is not None:
        config["chat_template"] = tok.chat_template
    (directory / "tokenizer.json").write_text(json.dumps(_hf_json(tok), ensure_ascii=False), encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2),
                                                     encoding="utf-8")
