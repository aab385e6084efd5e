"""Parallel sampling: n continuations ("choices", OpenAI's `n`) of one prompt, its prefill done once.

The n choices have the same prompt, so the same keys and values for it. Computing them n times would
cost n prefills and n copies of the prompt's KV blocks. Instead (as vLLM's parallel sampling does):

    1. the first choice alone is queued and prefilled;
    2. when its prompt is computed (its first token is due), the other choices fork from it: each takes a
       copy of its block table, every block's reference count going up by one (Scheduler.fork);
    3. all n sample their first token from the same logits row, each with its own generator;
    4. a block shared by several choices is copied the first time one of them writes into it
       (copy-on-write, Scheduler._reserve). Only the prompt's partly filled last block is ever written:
       the full blocks before it stay shared until the last choice lets go (BlockManager.release).

    prompt of 40 tokens, block_size 16, n = 3:
        shared:   [b0 b1] (full, refcount 3)   b2 (8 positions, refcount 3 until each choice writes)
        choice 0: b0 b1 b2'   choice 1: b0 b1 b2''   choice 2: b0 b1 b2   (the last writer keeps the original)

A choice that finds the batch full (max_batch) waits in the queue as a request of its own; its prompt's
full blocks are then likely prefix-cache hits.

Seeds: with a seed, choice 0 samples with that seed (so n = 1 is unchanged) and choice i > 0 with
`choice_seed(seed, i)`, a seed derived by NumPy's SeedSequence: the choices differ from each other, the
same request repeats exactly, and choice i equals a request of its own with seed choice_seed(seed, i).
"""
from __future__ import annotations

import math

import numpy as np


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed choice `index` of a request seeded `seed` samples with (None: unseeded, every choice fresh)."""
    if seed is None or index == 0:
        return seed
    # SeedSequence mixes (seed, index) into well-spread state: seed and seed + 1 give unrelated children.
    return int(np.random.SeedSequence(seed, spawn_key=(index,)).generate_state(1, np.uint64)[0])


def blocks_for_choices(n_prompt: int, max_tokens: int, n: int, block_size: int) -> int:
    """KV blocks n choices hold at most together: the prompt's full blocks once, every other block n times."""
    shared = n_prompt // block_size                                  # never written again: shared to the end
    per_choice = math.ceil((n_prompt + max_tokens - 1) / block_size) - shared   # the last token is never computed
    return shared + n * per_choice


def max_tokens_for_choices(n_prompt: int, n: int, block_size: int, num_blocks: int) -> int:
    """The most new tokens each of n choices may have for all n to fit `num_blocks` at once (< 1: none fit)."""
    shared = n_prompt // block_size
    return block_size * (shared + (num_blocks - shared) // n) - n_prompt + 1
