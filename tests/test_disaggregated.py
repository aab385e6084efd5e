"""Disaggregated prefill and decode (minillm/engine/disaggregated.py): a prefill worker's KV blocks, handed to a
decode worker in another process, decode the same greedy tokens as one process with one contiguous cache."""
import functools
import multiprocessing

import numpy as np
import pytest

from minillm.engine.disaggregated import (Handoff, decode_from_blocks, install_blocks, prefill_blocks,
                                          receive_handoff, run_disaggregated, send_handoff)
from minillm.engine.paged_kv import BlockManager, PagedKVCache
from minillm.model.config import ModelConfig
from minillm.model.transformer import Transformer
from minillm.tools.bench import random_model

CONFIG = ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=256)
PROMPT = [int(t) for t in np.random.default_rng(1).integers(0, 97, 37)]     # 37: a partly filled last block


def tiny_model(seed: int = 4) -> Transformer:
    """Random weights 25x the usual 0.02 scale, so greedy tokens vary (a flat model repeats one token)."""
    tensors = random_model(CONFIG, seed).hf_tensors()
    return Transformer(CONFIG, {name: a * 25 if a.ndim == 2 else a for name, a in tensors.items()})


def single_process_greedy(model, prompt, n_new) -> list[int]:
    cache = model.new_cache(len(prompt) + n_new)
    tokens = [int(np.argmax(model.prefill(prompt, cache)))]
    while len(tokens) < n_new:
        tokens.append(int(np.argmax(model.decode(tokens[-1], cache))))
    return tokens


@pytest.mark.parametrize("block_size", [1, 5, 16, 64])
def test_handed_over_blocks_decode_the_single_process_tokens(block_size):
    model = tiny_model()
    want = single_process_greedy(model, PROMPT, 12)
    assert len(set(want)) > 3                                          # the comparison is not trivially equal
    handoff = prefill_blocks(model, PROMPT, block_size)
    n_blocks = -(-len(PROMPT) // block_size)
    assert handoff.k.shape == (CONFIG.n_layers, n_blocks, block_size, CONFIG.n_kv_heads, CONFIG.head_dim)
    assert handoff.nbytes == n_blocks * block_size * CONFIG.kv_bytes_per_token(4)
    assert decode_from_blocks(model, handoff, 12) == want


def test_blocks_installed_beside_another_sequence_decode_the_same_tokens_and_leave_it_alone():
    model = tiny_model()
    want = single_process_greedy(model, PROMPT, 10)
    handoff = prefill_blocks(model, PROMPT, 8)
    pool, manager = PagedKVCache(CONFIG, 16, 8), BlockManager(16)
    other = [manager.allocate() for _ in range(6)]                     # another sequence holds blocks 0-5
    pool.k[:, other] = 7.0
    assert decode_from_blocks(model, handoff, 10, pool, manager) == want
    assert (pool.k[:, other] == 7.0).all()                             # its keys are untouched
    with pytest.raises(ValueError, match="blocks of 8 positions"):
        install_blocks(PagedKVCache(CONFIG, 16, 4), BlockManager(16), handoff)


def test_two_processes_decode_the_single_process_tokens_and_report_the_handoff():
    model = tiny_model()
    run = run_disaggregated(functools.partial(tiny_model), PROMPT, 10, block_size=8)
    assert run.tokens == single_process_greedy(model, PROMPT, 10)
    assert run.handoff_bytes == 5 * 8 * CONFIG.kv_bytes_per_token(4)  # 5 blocks of 8 for 37 positions
    assert run.prefill_s > 0 and run.handoff_s > 0 and run.decode_s > 0


def test_other_weights_in_the_decode_worker_give_other_tokens():
    # the check above can fail: blocks from one model decoded by another do not give the first model's tokens
    handoff = prefill_blocks(tiny_model(4), PROMPT, 8)
    assert decode_from_blocks(tiny_model(5), handoff, 10) != single_process_greedy(tiny_model(4), PROMPT, 10)


def test_the_channel_carries_bytes_and_refuses_a_handoff_that_does_not_fit():
    handoff = prefill_blocks(tiny_model(), PROMPT, 16)
    a, b = multiprocessing.Pipe()
    send_handoff(a, handoff)
    got = receive_handoff(b, CONFIG)
    assert (got.first_token, got.length) == (handoff.first_token, handoff.length)
    assert np.array_equal(got.k, handoff.k) and np.array_equal(got.v, handoff.v)
    for sent, config, refusal in [(handoff, CONFIG.replace(n_kv_heads=1), "does not fit this model's cache"),
                                  (Handoff(1, 99, handoff.k, handoff.v), CONFIG, "99 positions does not fit")]:
        a, b = multiprocessing.Pipe()                                  # a refused handoff leaves its blocks unread
        send_handoff(a, sent)
        with pytest.raises(ValueError, match=refusal):
            receive_handoff(b, config)


def test_a_failing_worker_is_one_error_in_the_parent():
    with pytest.raises(RuntimeError, match="prefill worker failed: IndexError"):
        run_disaggregated(functools.partial(tiny_model), [500], 3)      # token 500 is outside the vocabulary
