"""Exercise 18 (lesson 18): how many prompt tokens the prefix cache can serve.

Write `cached_prefix_tokens` below, then check it:
    minillm exercise check 18          (in a clone: pytest lessons/exercises --exercise 18)
The grader compares it with the engine's `minillm.engine.prefix_cache` (hashed full blocks, vLLM's design).
"""


def cached_prefix_tokens(prompt: list[int], cached: list[list[int]], block_size: int) -> int:
    """The number of leading tokens of `prompt` whose KV blocks are already in the cache.

    Every full block of every sequence in `cached` was computed and kept. A block of a new prompt can
    be reused only if ALL tokens from the start of the prompt to the end of that block equal those
    of one cached sequence: a key depends on every token before it, not only on its own block. So:

    - match whole blocks only (a partly matching block is computed again),
    - only full blocks of the cached sequences exist (their last, partial block was never kept),
    - never the prompt's last token: its logits give the first new token, so it is always computed.

    Returns a multiple of block_size.  (The engine hashes each block with its parent's hash, so one
    dict lookup per block answers "is everything up to here cached?"; any correct method passes.)
    """
    raise NotImplementedError("write cached_prefix_tokens: see the docstring")


if __name__ == "__main__":   # `python lessons/exercises/ex18_cached_prefix.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise(18, __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
