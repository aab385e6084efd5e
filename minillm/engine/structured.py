"""Structured output: a grammar (a JSON schema, a regex, a Lark grammar, a list of choices) as a mask on the
next token, so the answer matches it whatever the temperature.

A grammar is a state machine over bytes; every token of the vocabulary is a string of bytes, so in each state
the tokens the grammar can still accept are a set: the mask. The sampler sets every other logit to -inf
before it picks (sampling.py), and the pick moves the machine to its next state. The answer cannot break
the grammar because no token that would break it can be drawn; it can only end early (max_tokens) or reach
a state with no token left (then the choice ends, finish_reason "stop").

The matching is llguidance's (the engine vLLM, SGLang, llama.cpp and TensorRT-LLM use): it builds a lexer
over minillm's own token bytes and fills a bitmask of ceil(vocab / 32) int32 words per step, into NumPy,
with the GIL dropped, in about 0.1 ms on SmolLM2 (lessons/BENCHMARKS.md). Lesson 27 builds a tiny one by hand.

    grammar = compile_grammar(tokenizer, vocab_size, response_format={"type": "json_object"})
    state = grammar.start()             # one per request
    allowed = state.allowed()           # bool [vocab]
    state.advance(token)

What a request may ask for (the OpenAI and vLLM shapes):
    response_format    {"type": "text" | "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}
                       ("strict": false is enforced all the same, as vLLM does)
    structured_outputs {"json": schema} | {"regex": str} | {"grammar": Lark or GBNF} | {"choice": [str, ...]}

JSON's whitespace is bounded (JSON_WHITESPACE: nothing, a space, or a newline and <= 20 of indent between
tokens), so a hot or weak model cannot write whitespace until max_tokens, yet pretty-printed JSON still fits.
"""
from __future__ import annotations

import json
import logging
import threading
import weakref
from dataclasses import dataclass

import numpy as np

from minillm.errors import InvalidValue

COMPILE_TIMEOUT_S = 2.0          # compiling one grammar may take this long, then the request is refused
STRUCTURED_KINDS = ("json", "regex", "grammar", "choice")


class GrammarError(InvalidValue):
    """A grammar that cannot be used: malformed, unsatisfiable, too slow to compile. `field` names the request
    field it came from (response_format, structured_outputs, tools, tool_choice)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class GrammarSource:
    """What to compile: the grammar in llguidance's terms, and the request field it came from."""
    text: str             # llguidance's grammar (from grammar_from)
    field: str


def grammar_source(response_format: dict | None = None, structured_outputs: dict | None = None) -> GrammarSource | None:
    """The grammar a request asks for in OpenAI's `response_format` or vLLM's `structured_outputs`; None if
    neither constrains the output. Raises GrammarError naming the field for a malformed one."""
    import llguidance as llg
    asked = _response_format(response_format, llg) if response_format is not None else None
    extension = _structured_outputs(structured_outputs, llg) if structured_outputs is not None else None
    if asked is not None and extension is not None:
        raise GrammarError("give response_format or structured_outputs, not both", "structured_outputs")
    return asked or extension


def _response_format(response_format, llg) -> GrammarSource | None:
    if not isinstance(response_format, dict):
        raise GrammarError("response_format must be an object with a type", "response_format")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_source({"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise GrammarError('response_format.json_schema must be an object with a "schema"', "response_format")
        # strict false or true, the schema is enforced (as vLLM does): a mask is free, a broken answer is not.
        return json_schema_source(spec.get("schema", {}), "response_format")
    raise GrammarError(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                       "response_format")


def _structured_outputs(spec, llg) -> GrammarSource | None:
    field = "structured_outputs"
    if not isinstance(spec, dict):
        raise GrammarError("structured_outputs must be an object", field)
    given = [k for k in STRUCTURED_KINDS if spec.get(k) is not None]
    if len(given) > 1:
        raise GrammarError(f"structured_outputs takes one of {', '.join(STRUCTURED_KINDS)}, not {len(given)}", field)
    if not given:
        return None                          # nothing asked for: no constraint
    kind, value = given[0], spec[given[0]]
    if kind == "json":
        schema = json.loads(value) if isinstance(value, str) and _is_json(value) else value
        return json_schema_source(schema, field)
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise GrammarError("structured_outputs.choice must be a list of non-empty strings", field)
        return GrammarSource(llg.grammar_from("choice", value), field)
    if not isinstance(value, str) or not value:
        raise GrammarError(f"structured_outputs.{kind} must be a non-empty string", field)
    try:
        return GrammarSource(llg.grammar_from("regex" if kind == "regex" else "grammar", value), field)
    except ValueError as e:                  # a GBNF grammar that does not convert
        raise GrammarError(f"structured_outputs.grammar: {e}", field) from None


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def json_schema_source(schema, field: str) -> GrammarSource:
    """A JSON schema as a grammar source; a $ref cycle that describes no value is refused here (llguidance
    would take it and then allow no token)."""
    import llguidance as llg
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"{field}: the JSON schema must be an object", field)
    if isinstance(schema, dict):
        _check_ref_cycles(schema, field)
    try:
        return GrammarSource(llg.LLMatcher.grammar_from_json_schema(bounded_whitespace(schema)), field)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"{field}: invalid JSON schema: {e}", field) from None


# Between two JSON tokens: nothing, one space, or a newline and up to 20 spaces or tabs of indent (llama.cpp's
# json-schema grammar allows the same). llguidance's default is any run of whitespace, and a weak or hot model
# then writes whitespace until max_tokens and never closes the value; this keeps pretty-printed answers, which
# SmolLM2 writes unmasked (lessons/BENCHMARKS.md), as they are, and bounds each gap to 21 characters.
JSON_WHITESPACE = r"(?: |\n[ \t]{0,20})?"


def bounded_whitespace(schema: dict | bool) -> dict | bool:
    """The schema with llguidance's whitespace between JSON tokens bounded (JSON_WHITESPACE); options the
    schema's own "x-guidance" sets win."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        return schema                      # false: no value matches; llguidance says so
    own = schema.get("x-guidance") if isinstance(schema.get("x-guidance"), dict) else {}
    return dict(schema, **{"x-guidance": {"whitespace_pattern": JSON_WHITESPACE, **own}})


def _check_ref_cycles(root: dict, field: str) -> None:
    """A $ref that leads back to itself through $refs and allOf/anyOf/oneOf alone (nothing of the value
    consumed on the way: no property, no item) can never be written out: refuse it."""
    def resolve(ref: str):
        node = root
        if not ref.startswith("#"):
            return None                      # a remote ref: llguidance reports it
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                return None                  # a missing target: llguidance names it
            node = node[part]
        return node

    def walk(node, chain: tuple[str, ...]):
        if not isinstance(node, dict):
            return
        ref = node.get("$ref")
        if isinstance(ref, str):
            if ref in chain:
                raise GrammarError(f"{field}: the JSON schema's $ref {ref!r} refers to itself through "
                                   f"{' -> '.join(chain + (ref,))} and describes no value", field)
            walk(resolve(ref), chain + (ref,))
        for key in ("allOf", "anyOf", "oneOf"):
            for sub in node.get(key, []) if isinstance(node.get(key), list) else []:
                walk(sub, chain)

    walk(root, ())
    for defs in ("$defs", "definitions"):
        for name, sub in (root.get(defs) or {}).items() if isinstance(root.get(defs), dict) else ():
            walk(sub, (f"#/{defs}/{name}",))


# ---- compiling -------------------------------------------------------------------------------------

_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()    # minillm Tokenizer -> {vocab: LLTokenizer}
_TOKENIZERS_LOCK = threading.Lock()


def token_bytes(tokenizer, vocab_size: int) -> list[bytes]:
    """Every token id's bytes as the matcher sees them: control tokens marked with a leading 0xFF (no text
    can produce them), ids past the tokenizer's vocabulary (a padded embedding) empty, so never allowed."""
    special = set(tokenizer.special_tokens.values())
    out = [b"\xff" + b if i in special else b for i, b in enumerate(tokenizer._bytes[:vocab_size])]
    return out + [b""] * (vocab_size - len(out))


def matcher_tokenizer(tokenizer, vocab_size: int):
    """llguidance's view of minillm's tokenizer (its token bytes, its end tokens); built once per tokenizer
    (~0.3 s for SmolLM2's 49k tokens)."""
    import llguidance as llg
    with _TOKENIZERS_LOCK:
        by_vocab = _TOKENIZERS.setdefault(tokenizer, {})
        if vocab_size not in by_vocab:
            ends = [i for i in tokenizer.eos_ids if i < vocab_size]
            wrapper = _Wrapper(tokenizer, token_bytes(tokenizer, vocab_size), ends)
            by_vocab[vocab_size] = llg.LLTokenizer(llg.TokenizerWrapper(wrapper), n_vocab=vocab_size,
                                                   eos_token=ends or None)
        return by_vocab[vocab_size]


class _Wrapper:
    """The shape llguidance.TokenizerWrapper reads: token bytes, end and start ids, and an encode call."""

    def __init__(self, tokenizer, tokens: list[bytes], ends: list[int]):
        self.tokens, self.eos_token_id, self.bos_token_id = tokens, ends[0] if ends else 0, tokenizer.bos_id
        self.special_token_ids = sorted(tokenizer.special_tokens.values())
        self._tokenizer = tokenizer

    def __call__(self, text: bytes | str) -> list[int]:
        text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        return self._tokenizer.encode(text)


class Grammar:
    """A compiled grammar: shared by every request that asks for it; `start()` gives each its own state."""

    def __init__(self, matcher, vocab_size: int, field: str):
        self._prototype, self.vocab_size, self.field = matcher, vocab_size, field

    def start(self) -> "GrammarState":
        return GrammarState(self._prototype.deep_copy(), self.vocab_size)


def compile_grammar(tokenizer, vocab_size: int, source: GrammarSource | None,
                    timeout_s: float = COMPILE_TIMEOUT_S) -> Grammar | None:
    """Build the matcher for `source` over this tokenizer; refuses (GrammarError) a grammar that is malformed,
    unsatisfiable, or takes longer than timeout_s (the compile goes on in the background, then is dropped)."""
    if source is None:
        return None
    import llguidance as llg
    lltok = matcher_tokenizer(tokenizer, vocab_size)
    built: list = []
    worker = threading.Thread(target=lambda: built.append(llg.LLMatcher(lltok, source.text, log_level=0)),
                              name="minillm-grammar", daemon=True)
    worker.start()                        # llguidance drops the GIL while it builds: the timeout can fire
    worker.join(timeout_s)
    if not built:
        raise GrammarError(f"{source.field}: the grammar took longer than {timeout_s:g} s to compile", source.field)
    matcher = built[0]
    if matcher.is_error():
        raise GrammarError(f"{source.field}: {_first_line(matcher.get_error())}", source.field)
    return Grammar(matcher, vocab_size, source.field)


def _first_line(error: str) -> str:
    """llguidance's error in one line: its first line, and the regex parser's own "error:" line if any."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    said = lines[:1] + [line for line in lines[1:] if line.startswith("error:")]
    return " ".join(said)[:300] if said else "invalid grammar"


class GrammarState:
    """One request's place in its grammar: which tokens may come next, and the token that came."""

    def __init__(self, matcher, vocab_size: int):
        self._matcher, self.vocab_size = matcher, vocab_size
        self._words = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)    # the bitmask, 32 tokens a word
        self._ready = False             # _words holds the mask of the current state

    def prepare(self) -> None:
        """Fill the mask for the current state (llguidance drops the GIL: the engine runs this beside the
        forward pass); the next `allowed()` reads it."""
        if not self._ready:
            self._matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
            self._ready = True

    def allowed(self) -> np.ndarray:
        """bool [vocab]: True for each token the grammar accepts next."""
        self.prepare()
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")     # [32 * words], little-endian words
        return bits[:self.vocab_size].astype(bool)

    def advance(self, token: int) -> bool:
        """Move past `token`; False if the grammar did not accept it (its state is then an error)."""
        self._ready = False
        return self._matcher.consume_token(int(token))

    @property
    def broken(self) -> bool:
        """The matcher is in an error state (it then allows only end tokens): no valid continuation is left."""
        return self._matcher.is_error()

    @property
    def finished(self) -> bool:
        """The grammar is complete and accepts no more text (only an end token)."""
        return self._matcher.is_stopped()


def constrained_pick(sampler, logits: np.ndarray, state: GrammarState | None) -> int | None:
    """The sampler's pick among the tokens `state` allows (any token without a grammar), the grammar moved past
    it; None when the grammar allows no token (or is broken): the answer ends there.    logits: [vocab]"""
    if state is None:
        return sampler(logits)
    allowed = state.allowed()
    if state.broken or not allowed.any():
        return None
    sampler.allowed_tokens = allowed              # the sampler's mask step (sampling.py, step 4)
    token = sampler(logits)
    state.advance(token)
    return token


def log_dead_end(n_tokens: int) -> None:
    """One line in the log: an answer ended because its grammar allowed no token after n_tokens."""
    logging.getLogger("minillm.engine").warning(
        "structured output: the grammar allows no token after %d generated tokens; the answer ends there "
        "(finish_reason stop)", n_tokens)
