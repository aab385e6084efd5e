"""Tokenizer files: reading GGUF tokenizer metadata and HF tokenizer.json, writing tokenizer.json.

The `Tokenizer` itself (tokenizer.py) knows nothing about files; these functions turn each format
into the keyword arguments of its constructor, and a Tokenizer back into HF's format.
"""
from __future__ import annotations

import json
import re
import struct
from contextlib import contextmanager
from pathlib import Path


from minillm.errors import MiniLLMError
from minillm.checkpoints.chat_template import check_template
from minillm.checkpoints.gguf_file import read_metadata
from minillm.checkpoints.tokenizer import (BYTE, CONTROL, GGUF_PRE_TOKENIZERS, NORMAL, SPACE_MARK, UNKNOWN, UNUSED,
                               USER_DEFINED, Tokenizer)

LLAMA3_PRE_NAMES = ("llama-bpe", "llama3", "llama-v3")


class TokenizerFileError(MiniLLMError, ValueError):
    """A tokenizer file that is corrupt or uses a part minillm does not implement; the message names both."""


class NoTokenizer(TokenizerFileError):
    """A GGUF file without tokenizer metadata (a weights-only file): not an error when loading weights."""


class TokenizerNotFound(MiniLLMError, FileNotFoundError):
    """No tokenizer file where one was asked for."""


@contextmanager
def _reading(where):
    """Whatever a malformed file makes the parsing raise becomes one line naming the file."""
    try:
        yield
    except MiniLLMError:
        raise
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, OverflowError, struct.error) as e:
        text = str(e) if not isinstance(e, KeyError) else f"missing key {e}"
        text = text if str(where) in text else f"{where}: {text}"
        raise TokenizerFileError(text if isinstance(e, ValueError) else f"{text} ({type(e).__name__})") from None


def is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _read_gguf_metadata(path: Path) -> dict:
    """The key/value metadata at the head of a GGUF file, without touching the tensors (gguf_file.py:
    well under a second where gguf.GGUFReader takes seconds)."""
    return read_metadata(path)


def args_from_gguf(path_or_reader) -> dict:
    """Constructor arguments from a GGUF file's tokenizer.* metadata."""
    if hasattr(path_or_reader, "fields"):   # an open gguf.GGUFReader (the file itself needs no gguf package)
        reader, where = path_or_reader, "GGUF file"
        meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    else:
        path = Path(path_or_reader)
        if not path.exists():
            raise FileNotFoundError(f"no GGUF file at {path}")
        if path.is_dir() or not is_gguf(path):
            raise ValueError(f"{path} is not a GGUF file (it does not start with the GGUF magic)")
        meta, where = _read_gguf_metadata(path), str(path)

    def get(key: str, default=None):
        return meta.get(f"tokenizer.{key}", default)

    model = get("ggml.model")
    if model is None:
        raise NoTokenizer(f"{where} holds no tokenizer (no tokenizer.ggml.model key)")
    tokens = get("ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ValueError(f"{where}: tokenizer.ggml.tokens is missing or empty")
    for key in ("ggml.token_type", "ggml.scores"):         # one entry per token, or the ids shift
        values = get(key)
        if values is not None and (not isinstance(values, list) or len(values) != len(tokens)):
            count = len(values) if isinstance(values, list) else "no"
            raise ValueError(f"{where}: tokenizer.{key} has {count} entries for {len(tokens)} tokens")
    args = dict(tokens=tokens, token_types=get("ggml.token_type") or [NORMAL] * len(tokens),
                bos_id=get("ggml.bos_token_id"), eos_id=get("ggml.eos_token_id"),
                unk_id=get("ggml.unknown_token_id"), chat_template=get("chat_template"))
    add_bos = get("ggml.add_bos_token")
    if get("ggml.add_eos_token"):             # an EOS after every prompt: not what minillm's prompts do
        raise ValueError(f"{where}: tokenizer.ggml.add_eos_token=true is not supported")
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
    """SentencePiece-style (characters, "▁" for spaces, <0xNN> byte fallback) rather than byte-level BPE."""
    model, text = data["model"], json.dumps([data.get("normalizer"), data.get("pre_tokenizer"),
                                             data.get("decoder")])
    if '"ByteLevel"' in json.dumps(data.get("pre_tokenizer")) and not model.get("byte_fallback"):
        return False                            # byte-level, whatever else (a Metaspace) cuts its text first
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


def args_from_hf(path, vocab_size: int | None = None) -> dict:
    """Constructor arguments from an HF tokenizer.json (+ tokenizer_config.json beside it).
    vocab_size: the model's, when the tokenizer is loaded for one (its ids must lie below it)."""
    path = Path(path)
    json_path = path / "tokenizer.json" if path.is_dir() else path
    if not json_path.exists():
        raise TokenizerNotFound(f"no tokenizer.json at {json_path}")
    try:
        data = json.loads(json_path.read_text(encoding="utf-8"))
        model = data["model"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{json_path} is not an HF tokenizer.json ({err})") from None
    if model.get("type") != "BPE":
        raise ValueError(f"{json_path}: only BPE tokenizers are supported, not {model.get('type')!r}")
    config_path = json_path.parent / "tokenizer_config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
    except ValueError as err:
        raise ValueError(f"{config_path} is not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} is not a JSON object")

    vocab: dict[str, int] = model.get("vocab")
    added = data.get("added_tokens") or []
    _check_ids(json_path, vocab, added, vocab_size)
    _check_added_flags(json_path, added)
    _check_merges(json_path, model.get("merges", []), vocab)
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
        if types[a["id"]] != BYTE:             # a trainer's <0xNN> specials are byte fallback all the same
            types[a["id"]] = CONTROL if a.get("special") else USER_DEFINED
    ids = {t: i for i, t in enumerate(tokens)}
    unk_id = ids.get(model.get("unk_token")) if model.get("unk_token") else None
    if unk_id is not None:
        types[unk_id] = UNKNOWN

    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
    bos = _token_string(config.get("bos_token"))
    eos = _token_string(config.get("eos_token"))
    # A user-defined token marked "normalized" (what `add_tokens` makes) is found after the normalizer, as
    # HF finds it; special tokens are always cut out of the raw text first (a message cannot spell one).
    normalized = [a["id"] for a in added if types[a["id"]] == USER_DEFINED and a.get("normalized", True)]
    args = dict(kind="spm" if spm else "bpe", tokens=tokens, token_types=types, merges=merges,
                bos_id=ids.get(bos), eos_id=ids.get(eos), unk_id=unk_id, normalized_ids=normalized,
                chat_template=_chat_template_from(config, json_path.parent))
    _check_components(json_path, data, spm)
    if spm:
        args["add_space_prefix"] = _spm_prefix_from_json(data)
        metaspace = _metaspace_of(data)
        if metaspace is not None:   # HF's Metaspace rules (not SentencePiece's), after any normalizer
            args["metaspace"], args["normalizer"] = metaspace, data.get("normalizer")
    else:                    # byte-level: the Tokenizer runs (or refuses, naming them) both parts
        args["pre_tokenizer"], args["normalizer"] = data.get("pre_tokenizer"), data.get("normalizer")
    if config.get("add_eos_token"):           # an EOS after every prompt: not what minillm's prompts do
        raise ValueError(f"{config_path}: add_eos_token=true is not supported")
    add_bos = config.get("add_bos_token")
    if add_bos is None:      # no flag: does the post-processor put BOS in front of a sequence?
        single = _template_single(data.get("post_processor")) or [{}]
        add_bos = bos is not None and single[0].get("SpecialToken", {}).get("id") == bos
    args["add_bos"] = bool(add_bos)
    return args


def _steps(component: dict | None, key: str) -> list[dict]:
    """A component's parts: the list inside a Sequence, or the component itself."""
    if not component:
        return []
    if not isinstance(component, dict):
        raise ValueError(f"expected an object, got {component!r}")
    return component.get(key) or [] if component.get("type") == "Sequence" else [component]


def _template_single(post: dict | None) -> list[dict] | None:
    """The `single` template of a TemplateProcessing post-processor (inside a Sequence too), if any."""
    for step in _steps(post, "processors"):
        if step.get("type") == "TemplateProcessing":
            return step.get("single")
    return None


def _check_components(json_path: Path, data: dict, spm: bool) -> None:
    """Refuse, naming it, every tokenizer.json part that would change the ids and that minillm does not
    implement: ignoring it would tokenize differently from HF `tokenizers` without a word."""
    def refuse(part: str, what) -> None:
        raise ValueError(f"{json_path}: {part} {json.dumps(what)[:200]} is not supported")

    model = data["model"]
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            refuse(f"model.{key}", model[key])
    if model.get("dropout"):                    # HF would drop merges at random on every encode
        refuse("model.dropout", model["dropout"])
    for step in _steps(data.get("post_processor"), "processors"):
        kind = step.get("type")
        if kind == "TemplateProcessing":
            single = step.get("single") or []
            text_at = [i for i, piece in enumerate(single) if "Sequence" in piece]
            if text_at != [len(single) - 1] or len(single) > 2:      # [BOS] $A only: no EOS after the text
                refuse("post_processor TemplateProcessing single", single)
        elif kind != "ByteLevel":               # ByteLevel's post-processing only trims offsets
            refuse("post_processor", {"type": kind})
    if not spm:
        return                                  # byte-level pre-tokenizers: tokenizer._regex_for refuses
    if _metaspace_of(data) is not None:
        return                                  # its normalizer: the Tokenizer runs or refuses it
    replaces_spaces = False
    for step in _steps(data.get("normalizer"), "normalizers"):
        replace = step.get("type") == "Replace" and step.get("pattern") == {"String": " "} and \
            step.get("content") == SPACE_MARK
        if not (replace or (step.get("type") == "Prepend" and step.get("prepend") == SPACE_MARK)):
            refuse("normalizer", step)
        replaces_spaces |= replace
    if not replaces_spaces:                     # HF would keep the spaces; SentencePiece's rules make them "▁"
        raise ValueError(f"{json_path}: a SentencePiece-style tokenizer.json without a Metaspace pre-tokenizer "
                         f"needs the normalizer Replace(' ', '{SPACE_MARK}'): one that keeps spaces is not supported")
    for step in _steps(data.get("pre_tokenizer"), "pretokenizers"):
        if step.get("type") == "Split" and step.get("pattern") == {"String": " "}:
            continue        # Gemma's (transformers 5): a split on spaces the normalizer already made "▁" never cuts
        if step.get("type") != "Metaspace" or step.get("replacement", SPACE_MARK) != SPACE_MARK:
            refuse("pre_tokenizer", step)


def _metaspace_of(data: dict) -> dict | None:
    """The Metaspace pre-tokenizer of a SentencePiece-style tokenizer.json, when it is its only one."""
    steps = _steps(data.get("pre_tokenizer"), "pretokenizers")
    return steps[0] if len(steps) == 1 and steps[0].get("type") == "Metaspace" else None


MAX_VOCAB = 1 << 24      # ids past this are corruption, not a vocabulary (the largest real ones are ~260K)


def _check_ids(json_path: Path, vocab, added, vocab_size: int | None) -> None:
    """model.vocab maps strings to ids, added_tokens have an id and a content; every id in 0..MAX_VOCAB,
    below the model's vocab_size when given, and the ids number the tokens present (holes allowed, as
    many as there are tokens at most). Checked before anything is built with one entry per id."""
    if not isinstance(vocab, dict) or not vocab:
        raise ValueError(f"{json_path}: model.vocab must be a non-empty object of token -> id")
    if not isinstance(added, list) or not all(isinstance(a, dict) and isinstance(a.get("content"), str)
                                              for a in added):
        raise ValueError(f"{json_path}: added_tokens must be a list of objects with an id and a content")
    for where, i in [*(("model.vocab", i) for i in vocab.values()), *(("added_tokens", a.get("id")) for a in added)]:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < MAX_VOCAB:
            raise ValueError(f"{json_path}: {where} has the id {i!r}; ids are integers from 0 to {MAX_VOCAB - 1}")
    ids = {*vocab.values(), *(a["id"] for a in added)}
    largest = max(ids)
    if vocab_size is not None and largest >= vocab_size:    # its ids would index past the embedding
        raise ValueError(f"{json_path}: the token id {largest} is past the model's vocab_size {vocab_size}: "
                         "the tokenizer and the model do not belong together")
    if largest >= 2 * len(ids):
        raise ValueError(f"{json_path}: the token id {largest} leaves {largest + 1 - len(ids)} ids without a token "
                         f"among {len(ids)} tokens; minillm reads at most as many such holes as tokens")


def _check_added_flags(json_path: Path, added: list[dict]) -> None:
    """HF strips the spaces beside an lstrip / rstrip token and matches a single_word one only as a whole word;
    minillm's tokenizer does neither, so such a token is refused rather than encoded around differently."""
    for a in added:
        flags = [flag for flag in ("lstrip", "rstrip", "single_word") if a.get(flag)]
        if flags:
            raise ValueError(f"{json_path}: the added token {a['content']!r} sets {' and '.join(flags)}, which "
                             "minillm's tokenizer does not implement (it would encode text around it differently)")


def _check_merges(json_path: Path, merges, vocab: dict) -> None:
    """Each merge is two vocab tokens whose join is a vocab token too, as HF `tokenizers` requires (a merge
    we skipped would tokenize differently from HF without a word)."""
    if not isinstance(merges, list):
        raise ValueError(f"{json_path}: model.merges must be a list")
    for n, m in enumerate(merges):
        pair = m.split(" ") if isinstance(m, str) else m
        if not isinstance(pair, (list, tuple)) or len(pair) != 2 or not all(isinstance(t, str) for t in pair):
            raise ValueError(f"{json_path}: model.merges[{n}] = {m!r} is not a pair of tokens")
        for piece in (pair[0], pair[1], pair[0] + pair[1]):
            if piece not in vocab:
                raise ValueError(f"{json_path}: model.merges[{n}] = {m!r} uses {piece!r}, which is not in model.vocab")


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
              "normalized": i in tok.normalized_ids, "special": tok.token_types[i] != USER_DEFINED}
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
        pre, normalizer = tok.pre_tokenizer, tok.normalizer
        decoder = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    else:
        model.update(merges=[list(m) for m in _spm_merges(tok)], fuse_unk=True, byte_fallback=True,
                     unk_token=tok.tokens[tok.unk_id] if tok.unk_id is not None else None)
        # Normalizer rather than a Metaspace pre-tokenizer: Metaspace skips the dummy prefix when
        # the text already starts with a space, unlike SentencePiece (" Hello" -> "▁▁Hello"); HF runs
        # it on each stretch between special tokens, as minillm and llama.cpp prefix a GGUF's.
        replace = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE_MARK}
        prepend = [{"type": "Prepend", "prepend": SPACE_MARK}] if tok.add_space_prefix else []
        pre, normalizer = None, {"type": "Sequence", "normalizers": [*prepend, replace]}
        if tok.metaspace is not None:           # read from a tokenizer.json with HF's Metaspace: keep its rules
            pre, normalizer = tok.metaspace, tok.normalizer
        steps = [{"type": "Replace", "pattern": {"String": SPACE_MARK}, "content": " "},
                 {"type": "ByteFallback"}, {"type": "Fuse"}]
        if tok.add_space_prefix:
            steps.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
        decoder = {"type": "Sequence", "decoders": steps}
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": normalizer, "pre_tokenizer": pre, "post_processor": post, "decoder": decoder,
            "model": model}


def save_hf(tok: Tokenizer, directory: Path) -> None:
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


def tokenizer_from_gguf(path_or_reader) -> Tokenizer:
    """The tokenizer stored in a GGUF file (a model file or a vocab-only one); TokenizerFileError if it
    is corrupt or unsupported, NoTokenizer if the file holds none."""
    with _reading(getattr(path_or_reader, "path", path_or_reader)):
        return _checked(Tokenizer(**args_from_gguf(path_or_reader)))


def tokenizer_from_hf(path, vocab_size: int | None = None) -> Tokenizer:
    """An HF tokenizer: a folder with tokenizer.json (+ tokenizer_config.json) or the json itself;
    TokenizerFileError naming the file and the part if it is corrupt or uses what is not implemented.
    vocab_size: the model's, when loaded for one: an id at or past it is refused before anything is built."""
    with _reading(path):
        return _checked(Tokenizer(**args_from_hf(path, vocab_size)))


def _checked(tok: Tokenizer) -> Tokenizer:
    """A chat template that does not parse, or that breaks its sandbox on a plain conversation, is a
    broken file: say so at load, not at the first chat."""
    if tok.chat_template is not None:
        check_template(tok.chat_template, tok.template_tokens())
    return tok


def load_tokenizer(path) -> Tokenizer:
    """Load a tokenizer from a .gguf file (vocab-only is fine), a folder, or a tokenizer.json."""
    path = Path(path)
    if not path.exists():
        raise TokenizerNotFound(f"no tokenizer at {path}: expected a .gguf file, a tokenizer.json, "
                                "or a folder holding tokenizer.json")
    if path.is_dir():
        if (path / "tokenizer.json").exists():
            return tokenizer_from_hf(path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return tokenizer_from_gguf(ggufs[0])
        raise TokenizerFileError(f"{path} holds no tokenizer.json (and not exactly one .gguf file)")
    if is_gguf(path):
        return tokenizer_from_gguf(path)
    if path.suffix == ".json":
        return tokenizer_from_hf(path)
    raise TokenizerFileError(f"{path} is not a tokenizer file: expected a GGUF file or an HF tokenizer.json")
