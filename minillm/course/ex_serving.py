"""Exercises 16-19, serving many users: the paged pool's block table, the packed batch, the prefix
cache, and reading a streamed answer (server-sent events). Each has its cases, its check and its reference."""
from __future__ import annotations

import numpy as np

from minillm.course.cases import Case, CaseFailed, _expect_tuple, case_rng, expect_close, expect_unchanged


def gather_reference(pool: np.ndarray, block_table, length: int) -> np.ndarray:
    """The engine's PagedKVCache.read for one layer's pool given by the caller.   -> [n_kv, length, hd]"""
    from minillm.model.config import ModelConfig
    from minillm.engine.paged_kv import PagedKVCache
    n_blocks, block_size, n_kv, hd = pool.shape
    shape = ModelConfig(vocab_size=1, dim=n_kv * hd, n_layers=1, n_heads=n_kv, n_kv_heads=n_kv, ffn_dim=1,
                        head_dim=hd)
    paged = PagedKVCache(shape, 0, block_size)
    paged.k = paged.v = pool[None]                       # the caller's pool as layer 0 (no copy)
    return paged.read(0, list(block_table), length)[0]


def _gather_cases() -> list[Case]:
    def case(name, n_blocks, bs, n_kv, hd, table, length):
        return Case(name, dict(n_blocks=n_blocks, bs=bs, n_kv=n_kv, hd=hd, table=table, length=length))
    return [case("a table in order: blocks 0, 1, 2 of 4 positions, 12 positions", 6, 4, 2, 8, [0, 1, 2], 12),
            case("a scattered table [5, 2, 7]: the table decides the order", 8, 4, 2, 8, [5, 2, 7], 12),
            case("the last block partly filled: 10 positions in 3 blocks of 4", 8, 4, 2, 8, [6, 0, 3], 10),
            case("a table with more blocks than needed: 6 positions, 4 blocks listed", 8, 4, 3, 4, [3, 1, 4, 0], 6),
            case("one position", 4, 4, 1, 8, [2], 1),
            case("SmolLM2's heads: 3 KV heads, head_dim 64, blocks of 16, 40 positions", 10, 16, 3, 64, [9, 4, 7], 40)]


def _check_gather(fn, case: Case) -> str:
    c = case.inputs
    rng = case_rng(c["n_blocks"] * 7 + c["length"])
    pool = rng.standard_normal((c["n_blocks"], c["bs"], c["n_kv"], c["hd"])).astype(np.float32)
    pool_in = pool.copy()
    got = fn(pool_in, list(c["table"]), c["length"])
    expect_unchanged("pool", pool, pool_in)
    want = gather_reference(pool, c["table"], c["length"])
    length, n_kv, hd = c["length"], c["n_kv"], c["hd"]
    if isinstance(got, np.ndarray) and got.shape == (length, n_kv, hd) and n_kv != length:
        raise CaseFailed(f"returned [length, n_kv_heads, head_dim] = {list(got.shape)}; attention wants the "
                         f"heads first: transpose to {list(want.shape)}")
    if isinstance(got, np.ndarray) and got.shape[:1] == (n_kv,) and got.ndim == 3 and got.shape[1] > length:
        raise CaseFailed(f"returned {got.shape[1]} positions: cut the gathered blocks to the first {length}")
    if isinstance(got, np.ndarray) and got.shape == want.shape and c["table"] != sorted(c["table"]):
        in_order = gather_reference(pool, list(range(len(c["table"]))), length)
        if np.array_equal(got, in_order):
            raise CaseFailed("read blocks 0, 1, 2, ... of the pool; read the blocks the table names, in its order")
    return expect_close("keys", got, want, rtol=0, atol=0)


def pack_reference(chunks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The engine's batched.pack for (token_ids, start) pairs."""
    from minillm.engine.batched import SeqChunk, pack
    return pack([SeqChunk(list(tokens), start, []) for tokens, start in chunks])


def _pack_cases() -> list[Case]:
    rng = case_rng(17)

    def toks(n):
        return rng.integers(0, 1000, n).tolist()
    return [Case("one prompt of 5 tokens", dict(chunks=[(toks(5), 0)])),
            Case("a decode step of 3 sequences at positions 37, 5, 120", dict(chunks=[([7], 37), ([8], 5), ([9], 120)])),
            Case("mixed: a prompt, a decode, and a prompt's second chunk from position 8",
                 dict(chunks=[(toks(5), 0), ([3], 37), (toks(12), 8)])),
            Case("a one-token prompt first", dict(chunks=[([42], 0), (toks(4), 0)])),
            Case("a long chunk between two decodes", dict(chunks=[([1], 99), (toks(30), 16), ([2], 3)]))]


def _check_pack(fn, case: Case) -> str:
    chunks = case.inputs["chunks"]
    got = _expect_tuple(fn([(list(t), s) for t, s in chunks]), 3, "tokens, positions, last_rows")
    tokens, positions, last_rows = pack_reference(chunks)
    for name, g, w in (("tokens", got[0], tokens), ("positions", got[1], positions)):
        if g.shape != w.shape or not np.array_equal(g, w):
            if name == "positions" and g.shape == w.shape:
                if np.array_equal(g, np.arange(len(w))):
                    raise CaseFailed("positions count through the whole batch; each sequence has its own positions, "
                                     "from its chunk's `start`")
                if np.array_equal(g, np.concatenate([np.arange(len(t)) for t, _ in chunks])):
                    raise CaseFailed("positions restart at 0 for every chunk; they continue from the chunk's `start` "
                                     "(the positions already in the cache)")
            raise CaseFailed(f"{name} {g.tolist()[:12]} != expected {w.tolist()[:12]}")
    if last_rows.shape == got[2].shape and np.array_equal(got[2], last_rows + 1):
        raise CaseFailed("last_rows are one past each chunk's end: the last token of a chunk ending at row "
                         "r (exclusive) is row r - 1")
    if got[2].shape != last_rows.shape or not np.array_equal(got[2], last_rows):
        raise CaseFailed(f"last_rows {got[2].tolist()} != expected {last_rows.tolist()}")
    return f"{len(tokens)} tokens of {len(chunks)} sequences; last rows {last_rows.tolist()}"


def cached_prefix_reference(prompt: list[int], cached: list[list[int]], block_size: int) -> int:
    """What the engine's scheduler reuses: the PrefixCache's longest run of hashed full blocks."""
    from minillm.engine.prefix_cache import PrefixCache, block_hashes
    cache = PrefixCache()
    for i, seq in enumerate(cached):
        for j, h in enumerate(block_hashes(seq, block_size)):
            cache.insert(h, i * 100_000 + j)             # every cached sequence's full blocks
    n_blocks = (len(prompt) - 1) // block_size           # the last token is always computed
    return len(cache.match(block_hashes(prompt, block_size)[:n_blocks])) * block_size


def _prefix_cases() -> list[Case]:
    rng = case_rng(18)

    def toks(n):
        return rng.integers(100, 1000, n).tolist()
    system, other = toks(40), toks(40)
    long_chat = system + toks(30)
    return [Case("nothing cached", dict(prompt=toks(20), cached=[], block_size=16)),
            Case("a cached 40-token system prompt, blocks of 16: its 2 full blocks",
                 dict(prompt=system + toks(10), cached=[system], block_size=16)),
            Case("the same block of tokens after a different start is no match",
                 dict(prompt=other[:16] + system[16:40] + toks(5), cached=[system], block_size=16)),
            Case("block 2 equals another sequence's block 2, after a different block 1: no match past block 1",
                 dict(prompt=system[:16] + other[16:32] + toks(9), cached=[system, other], block_size=16)),
            Case("the prompt is a cached sequence: its last token is computed again",
                 dict(prompt=system[:32], cached=[system[:32]], block_size=16)),
            Case("a divergence inside a block: only the blocks before it",
                 dict(prompt=system[:21] + toks(20), cached=[system], block_size=4)),
            Case("two cached sequences: the longer match counts",
                 dict(prompt=long_chat + toks(3), cached=[system, long_chat, other], block_size=8)),
            Case("the prompt runs past the end of a cached sequence: that sequence's full blocks",
                 dict(prompt=system + toks(20), cached=[system], block_size=16))]


def _check_prefix(fn, case: Case) -> str:
    c = case.inputs
    got = fn(list(c["prompt"]), [list(s) for s in c["cached"]], c["block_size"])
    want = cached_prefix_reference(c["prompt"], c["cached"], c["block_size"])
    if not isinstance(got, (int, np.integer)):
        raise CaseFailed(f"returned {type(got).__name__}, expected an int (a number of tokens)")
    if got == want:
        return f"{want} tokens reused"
    prompt, bs = c["prompt"], c["block_size"]
    common = max([_common_prefix(prompt, s) for s in c["cached"]] + [0])
    if got == (common // bs) * bs and got > want:
        raise CaseFailed(f"returned {got}: the prompt's last token must always be computed (its logits give the "
                         f"first new token), so at most {(len(prompt) - 1) // bs} blocks: expected {want}")
    if got == min(common, len(prompt) - 1) or got == common:
        raise CaseFailed(f"returned {got}, the tokens in common; only whole blocks are reused: {want}")
    if got % bs:
        raise CaseFailed(f"returned {got}, not a multiple of block_size {bs}: blocks are reused whole")
    raise CaseFailed(f"returned {got}, expected {want}")


def _common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# 19: reading a streamed answer (server-sent events) ---------------------------------------------------

def stream_text_reference(body: str) -> tuple[str, str | None]:
    """The engine's own SSE reader: minillm.tools.serve_client_bench.stream_text (`minillm bench serve --url`)."""
    from minillm.tools.serve_client_bench import stream_text
    return stream_text(body)


def _sse_body(chunks: list[dict], newline: str = "\n", comments: bool = False) -> str:
    """A streamed response body as a server writes it: `data: <json>` events, each ended by a blank line."""
    import json
    events = [f"data: {json.dumps(c)}" for c in chunks] + ["data: [DONE]"]
    if comments:                                     # proxies and servers send these to keep a connection open
        events[1:1] = [": keep-alive"]
        events.insert(0, ": keep-alive")
    return "".join(e + newline + newline for e in events)


def _completion_chunks(pieces: list[str], finish: str) -> list[dict]:
    def chunk(text, reason=None):
        return {"id": "cmpl-19", "object": "text_completion",
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]}
    return [chunk(p) for p in pieces] + [chunk("", finish)]


def _chat_chunks(pieces: list[str], finish: str) -> list[dict]:
    def chunk(delta, reason=None):
        return {"id": "chatcmpl-19", "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}
    return [chunk({"role": "assistant", "content": ""})] + [chunk({"content": p}) for p in pieces] + [chunk({}, finish)]


def _sse_cases() -> list[Case]:
    usage = {"id": "cmpl-19", "object": "text_completion", "choices": [],
             "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}}
    return [Case("completions: the text is in choices[0].text",
                 dict(body=_sse_body(_completion_chunks(["Once", " upon", " a"], "length")))),
            Case("chat: a role chunk first, then the text in choices[0].delta.content",
                 dict(body=_sse_body(_chat_chunks(["Hello", " there", "!"], "stop")))),
            Case("a usage chunk with no choices before [DONE] (stream_options.include_usage)",
                 dict(body=_sse_body(_completion_chunks(["The", " sky"], "length") + [usage]))),
            Case("CRLF line endings and ': keep-alive' comment lines",
                 dict(body=_sse_body(_chat_chunks(["a", "b", "c"], "stop"), newline="\r\n", comments=True))),
            Case("newlines, quotes and non-ASCII text, escaped inside the JSON",
                 dict(body=_sse_body(_chat_chunks(["line 1\n", 'a "quote"', " café ☕"], "stop")))),
            Case("an empty answer: only the role chunk and the finish chunk",
                 dict(body=_sse_body(_chat_chunks([], "stop"))))]


def _sse_hidden(seed: int) -> list[Case]:
    """Fresh answers, in both formats, with and without keep-alive comments and CRLF."""
    rng = np.random.default_rng([seed, 19])
    words = ["the", " cat", " sat", "\n", ' "quoted"', " naïve", " ☕", " 42", "", " end."]
    cases = []
    for i in range(5):
        pieces = [str(w) for w in rng.choice(words, size=int(rng.integers(0, 8)))]
        finish = str(rng.choice(["stop", "length"]))
        chunks = _chat_chunks(pieces, finish) if i % 2 else _completion_chunks(pieces, finish)
        body = _sse_body(chunks, newline="\r\n" if rng.integers(0, 2) else "\n", comments=bool(rng.integers(0, 2)))
        cases.append(Case(f"{'chat' if i % 2 else 'completions'}: {len(pieces)} pieces, {finish}", dict(body=body)))
    return cases


def _check_sse(fn, case: Case) -> str:
    body = case.inputs["body"]
    got = fn(body)
    want_text, want_finish = stream_text_reference(body)
    if not (isinstance(got, tuple) and len(got) == 2):
        raise CaseFailed(f"returned {type(got).__name__} {_clip(got)}, expected a tuple (text, finish_reason)")
    text, finish = got
    if text != want_text:
        raise CaseFailed(f"text {_clip(text)} != expected {_clip(want_text)}")
    if finish != want_finish:
        raise CaseFailed(f"finish_reason {finish!r} != expected {want_finish!r} (the last one a chunk carries)")
    return f"text {_clip(want_text)}, finish_reason {want_finish!r}"


def _clip(value, n: int = 48) -> str:
    r = repr(value)
    return r if len(r) <= n else r[:n - 3] + "..."
