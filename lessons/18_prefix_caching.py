"""Lesson 18 — prefix caching for agents: compute a shared system prompt once, reuse its KV blocks.

An agent sends the same long prefix with every call: instructions, tool descriptions, the conversation
so far. Keys and values at a position depend only on the tokens up to it, so a prefix's KV blocks,
once computed, serve every later request that starts the same way; its prefill is skipped and its time
to first token drops. minillm finds them with vLLM's design: each full block is named by a hash of
(its parent's hash, its tokens), one dict lookup per block (`minillm.engine.prefix_cache`). SGLang's design is
a radix tree over token ids, matching to the exact token; this lesson builds one and compares the two,
then shows least-recently-used eviction deciding which prefixes stay when the pool is small.

Exercise 18.2 is this lesson's radix tree as data (a flat list of edges), grown request by request
through a branching conversation by the grader, which checks every match and the tree's shape.

Run: python lessons/18_prefix_caching.py      (MINILLM_LESSON_QUICK=1 for a smoke run)
"""
ABOUT = {                   # `minillm lesson N --about` prints this (minillm/course/lessons.py)
    "prerequisites": [
        "lesson 17 (continuous batching)",
    ],
    "objectives": [
        "share a prompt prefix's KV blocks by reference count",
        "compare hashed full blocks (vLLM) with a token-exact radix tree (SGLang)",
        "see LRU eviction defeated by cycling more prefixes than fit",
    ],
    "study_time": "50 min, plus 25 min for exercise 18 (cached prefix tokens)",
    "check_questions": [
        "Why do hashed blocks lose up to one block of reuse per request against a radix tree?",
        "Which workloads gain most from a prefix cache?",
    ],
    "try_this": [
        "minillm serve (prefix caching is on by default) and send the same system prompt twice; --no-prefix-caching to compare",
        "raise the number of system prompts past what the pool holds",
    ],
}
import os
import sys
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # stable timings on a shared machine (lesson 08)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

import numpy as np

from minillm.course.measure import check, load_average, load_line
from minillm.course import lesson_model, print_table, quick, save_plot
from minillm.engine.engine import Engine
from minillm.engine.prefix_cache import PrefixCache, block_hashes
from minillm.tools.serve_bench import agentic_workload, run_engine


# NEW: the other design, a radix tree (SGLang's RadixAttention) ----------------------------------------
class RadixNode:
    def __init__(self):
        self.children: dict[int, tuple[list[int], "RadixNode"]] = {}   # first token -> (edge tokens, child)


class RadixTree:
    """A trie over token ids whose edges hold runs of tokens (one edge per unbranched run). SGLang keeps
    the KV slots of each edge's tokens on it; here we keep only the tokens, to compare what matches."""

    def __init__(self):
        self.root = RadixNode()

    def match(self, tokens: list[int]) -> int:
        """How many leading tokens are already in the tree (to the token, not to the block)."""
        node, i = self.root, 0
        while i < len(tokens) and tokens[i] in node.children:
            edge, child = node.children[tokens[i]]
            n = _common(edge, tokens[i:])
            i += n
            if n < len(edge):
                break                                    # diverged inside an edge
            node = child
        return i

    def insert(self, tokens: list[int]) -> None:
        node, i = self.root, 0
        while i < len(tokens):
            if tokens[i] not in node.children:
                node.children[tokens[i]] = (tokens[i:], RadixNode())
                return
            edge, child = node.children[tokens[i]]
            n = _common(edge, tokens[i:])
            if n < len(edge):                            # split the edge where the new tokens diverge
                middle = RadixNode()
                middle.children[edge[n]] = (edge[n:], child)
                node.children[tokens[i]] = (edge[:n], middle)
                child = middle
            node, i = child, i + n


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
# ---------------------------------------------------------------------------------------------------


def hashed_match(cache: PrefixCache, tokens: list[int], block_size: int) -> int:
    """Tokens the engine's hashed blocks reuse (whole blocks; the last token is always computed)."""
    return len(cache.match(block_hashes(tokens, block_size)[:(len(tokens) - 1) // block_size])) * block_size


def hit_rate(llm, prompts: list[list[int]], num_blocks: int) -> float:
    """Fraction of prompt tokens served from the cache when these prompts arrive one after another."""
    engine = Engine(llm, num_blocks=num_blocks, max_batch=1)
    for p in prompts:
        engine.generate([p], max_tokens=1)
    s = engine.stats()
    return s["prefix_hit_tokens"] / sum(len(p) for p in prompts)


def main():
    small = quick()
    llm = lesson_model()
    vocab = llm.config.vocab_size
    rng = np.random.default_rng(0)

    # 1. An agentic workload through the engine, without and with the prefix cache.
    n_req, conc, prompt_len, out = (4, 2, 48, 2) if small else (12, 4, 256, 8)
    w = agentic_workload(n_req, vocab, prompt_len, out, prefix_share=0.85)
    load_start = load_average()
    runs = [run_engine(llm, w, conc, "no prefix cache", prefix_caching=False),
            run_engine(llm, w, conc, "prefix cache", prefix_caching=True)]
    prompt_tokens = sum(len(p) for p in w.prompts)
    agent_rows = [[r.mode, prompt_tokens - r.prefix_hit_tokens, r.prefix_hit_tokens,
                   f"{r.row()['ttft_mean_s'] * 1e3:.0f}", f"{r.row()['ttft_p90_s'] * 1e3:.0f}",
                   f"{r.row()['output_tok_per_s']:.1f}"] for r in runs]
    speedup = runs[0].row()["ttft_mean_s"] / runs[1].row()["ttft_mean_s"]

    # 2. Hashed blocks vs a radix tree on a branching conversation (blocks of 16).
    bs = 16
    system = rng.integers(100, vocab, 40).tolist()
    turn1 = system + rng.integers(100, vocab, 12).tolist()
    turn2 = turn1 + rng.integers(100, vocab, 20).tolist()               # the conversation goes on
    branch = turn1[:45] + rng.integers(100, vocab, 15).tolist()         # a retry edits turn 1 from token 45
    other = rng.integers(100, vocab, 30).tolist()                       # another user
    cache, tree, design_rows = PrefixCache(), RadixTree(), []
    for name, tokens in [("system + turn 1", turn1), ("+ turn 2", turn2), ("turn 1 edited at 45", branch),
                         ("another user", other)]:
        hashed, radix = hashed_match(cache, tokens, bs), tree.match(tokens)
        design_rows.append([name, len(tokens), hashed, radix, radix - hashed])
        for i, h in enumerate(block_hashes(tokens, bs)):                 # as if computed: blocks cached
            cache.insert(h, 1000 * len(design_rows) + i)
        tree.insert(tokens)

    # 3. LRU eviction: P distinct system prompts in turn, a pool that holds only some of them.
    n_prefix, sys_len = (3, 32) if small else (3, 64)
    systems = [rng.integers(100, vocab, sys_len).tolist() for _ in range(n_prefix)]
    rounds = [s + rng.integers(100, vocab, 8).tolist() for _ in range(3) for s in systems]
    own_blocks = -(-(sys_len + 9) // 16) - sys_len // 16     # a request's blocks past its system prompt
    lru_rows = []
    for keep in (1, n_prefix - 1, n_prefix):
        blocks = keep * (sys_len // 16) + own_blocks         # `keep` cached prefixes + one request running
        lru_rows.append([blocks, f"{keep} of {n_prefix}", f"{hit_rate(llm, rounds, blocks):.0%}"])

    print_table(f"Lesson 18 — {n_req} agent calls, {conc} at a time: a {int(0.85 * prompt_len)}-token system "
                f"prompt shared by prompts of ~{prompt_len} tokens",
                ["engine", "prompt tokens computed", "served from cache", "TTFT mean ms", "TTFT p90 ms",
                 "output tok/s"], agent_rows)
    print(f"TTFT: mean and p90 over the {n_req} calls of one run each; {load_line(load_start)}")
    check("a shared prefix served from the cache lowers the mean time to first token",
          speedup > 1, f"mean TTFT {speedup:.1f}x lower with the prefix cache")
    print("The first calls of a burst all miss: a block becomes findable once it is computed, so later arrivals\n"
          "are the ones that hit.")
    print_table("hashed full blocks (minillm, vLLM) vs a radix tree (SGLang): tokens reused, blocks of 16",
                ["request", "tokens", "hashed blocks", "radix tree", "radix extra"], design_rows)
    print("The tree matches to the token; hashed blocks stop at the last whole block that matches (and\n"
          "always compute the final token). Blocks are the engine's unit of memory anyway, so a hash per\n"
          "block is one dict lookup per 16 tokens and needs no tree to split; the tree's extra is under a\n"
          "block per request.")
    print_table(f"LRU eviction: {n_prefix} system prompts of {sys_len} tokens, each used 3 times in turn",
                ["pool blocks", "system prompts that fit", "prompt tokens from cache"], lru_rows)
    print("Unused cached blocks are evicted least recently used first. Cycling through more prefixes than\n"
          "fit evicts each one just before it comes back (LRU's worst case: no hits at all); when they all\n"
          "fit, every repeat reuses its system prompt's whole blocks (the first round computes them).")

    def draw(ax):
        ax.bar([r.mode for r in runs], [r.row()["ttft_mean_s"] * 1e3 for r in runs], color=["gray", "tab:green"])
        ax.set_ylabel("mean TTFT, ms"), ax.set_title("Lesson 18: a shared system prompt, computed once")
    save_plot("18_prefix_caching.png", draw)


if __name__ == "__main__":
    main()
