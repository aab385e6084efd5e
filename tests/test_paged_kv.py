"""The paged KV cache, the block manager and the prefix cache; batched forward passes through block tables."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import minillm
from hf_models import llama_config, mistral_config, save_random_model
from minillm.engine.batched import BatchedRunner, SeqChunk
from minillm.model.kv_cache import Int8KVCache
from minillm.engine.paged_kv import BlockManager, BlockTableCache, PagedKVCache, compare_allocation
from minillm.engine.prefix_cache import PrefixCache, block_hashes

TOL = 1e-4


@pytest.fixture(scope="module", params=["llama-gqa", "mistral-window"])
def llm(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    config = llama_config(n_heads=8, n_kv_heads=2) if request.param == "llama-gqa" else mistral_config(6)
    save_random_model(config, path)
    return minillm.load(str(path))


def _ids(n, seed):
    return np.random.default_rng(seed).integers(0, 320, n).tolist()


def _tables(manager, lengths, block_size):
    return [[manager.allocate() for _ in range(-(-n // block_size))] for n in lengths]


# ---- the pool -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_pool_reads_back_what_was_written_through_a_scattered_block_table(llm, dtype):
    cfg = llm.config
    pool = PagedKVCache(cfg, num_blocks=8, block_size=4, dtype=dtype)
    table = [6, 1, 4]                                           # not in order: the table decides
    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((cfg.n_kv_heads, 10, cfg.head_dim)).astype(np.float32) for _ in range(2))
    for start, stop in [(0, 7), (7, 8), (8, 10)]:               # a prefill, then two more writes
        blocks, offsets = pool.slots(table, start, stop)
        pool.write(1, blocks, offsets, k[:, start:stop].transpose(1, 0, 2), v[:, start:stop].transpose(1, 0, 2))
    got_k, got_v = pool.read(1, table, 10)                      # [n_kv, 10, hd]
    if dtype == "float32":
        np.testing.assert_array_equal(got_k, k)
        np.testing.assert_array_equal(got_v, v)
    else:                                                       # the same numbers as the contiguous int8 cache
        ref = Int8KVCache(cfg, 10)
        ref.length = 0
        want_k, want_v = ref.append(1, k, v)
        np.testing.assert_array_equal(got_k, want_k)
        np.testing.assert_array_equal(got_v, want_v)
    assert not pool.k[0].any()                                  # other layers untouched
    tail_k, tail_v = pool.read(1, [-1] + table[1:], 10, first_block=1)   # block 0 given back: never read
    np.testing.assert_array_equal(tail_k, got_k[:, 4:])
    np.testing.assert_array_equal(tail_v, got_v[:, 4:])


def test_transformer_runs_unchanged_through_a_block_table(llm):
    model = llm.model
    pool = PagedKVCache(llm.config, num_blocks=16, block_size=4)
    paged = BlockTableCache(pool, BlockManager(16))
    ids = _ids(13, 1)
    want = model.prefill(ids, model.new_cache(20), all_logits=True)
    got = model.prefill(ids[:9], paged, all_logits=True)
    got = np.concatenate([got] + [model.decode(t, paged)[None] for t in ids[9:]])
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert len(paged.block_table) == 4                          # 13 positions in blocks of 4
    paged.free()
    assert paged.manager.num_free == 16


# ---- batched forward passes vs Transformer.forward -------------------------------------------------

@pytest.mark.parametrize("kv", ["float32", "int8"])
def test_batched_prefill_logits_match_the_transformer_at_every_position(llm, kv):
    model, lengths = llm.model, [3, 17, 9, 30]
    prompts = [_ids(n, seed) for seed, n in enumerate(lengths)]
    manager, pool = BlockManager(32), PagedKVCache(llm.config, 32, 8, kv)
    tables = _tables(manager, lengths, 8)
    got = BatchedRunner(model, pool).forward([SeqChunk(p, 0, t) for p, t in zip(prompts, tables)], all_logits=True)
    reference = model.with_options(kv_cache=kv)
    want = np.concatenate([reference.prefill(p, reference.new_cache(len(p)), all_logits=True) for p in prompts])
    assert got.shape == (sum(lengths), llm.config.vocab_size)
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


def test_mixed_batch_of_prefill_chunks_and_decodes_matches_single_sequences(llm):
    """One step holding a decode, a first prompt chunk and a later prompt chunk, each at its own position."""
    model, runner = llm.model, None
    manager, pool = BlockManager(32), PagedKVCache(llm.config, 32, 4)
    runner = BatchedRunner(model, pool)
    a, b, c = _ids(11, 1), _ids(20, 2), _ids(7, 3)
    ta, tb, tc = _tables(manager, [12, 20, 7], 4)
    runner.forward([SeqChunk(a, 0, ta), SeqChunk(b[:8], 0, tb)])            # step 1: two prefills
    token = 5
    got = runner.forward([SeqChunk([token], 11, ta), SeqChunk(b[8:], 8, tb), SeqChunk(c, 0, tc)])   # step 2
    caches = [model.new_cache(32) for _ in range(3)]
    model.prefill(a, caches[0])
    want = [model.decode(token, caches[0]), model.prefill(b, caches[1]), model.prefill(c, caches[2])]
    np.testing.assert_allclose(got, np.stack(want), atol=TOL, rtol=0)


# ---- fragmentation ------------------------------------------------------------------------------

def test_paged_allocation_wastes_less_than_a_block_per_sequence():
    lengths, block, per_token = [5, 100, 33, 16, 700], 16, 1000
    r = compare_allocation(lengths, max_len=2048, block_size=block, bytes_per_token=per_token)
    assert r.used_bytes == sum(lengths) * per_token
    assert r.contiguous_bytes == len(lengths) * 2048 * per_token
    assert r.paged_bytes == (1 + 7 + 3 + 1 + 44) * block * per_token
    assert r.paged_bytes - r.used_bytes < len(lengths) * block * per_token
    assert r.contiguous_waste > 0.9 > 0.05 > r.paged_waste


# ---- the prefix cache ---------------------------------------------------------------------------

def test_block_hashes_name_the_whole_prefix_not_just_the_block():
    same_block = [7, 8, 9, 10]
    a = block_hashes([1, 2, 3, 4] + same_block, 4)
    b = block_hashes([1, 2, 3, 5] + same_block, 4)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]          # same tokens after different prefixes
    assert block_hashes([1, 2, 3, 4] + same_block + [1, 2], 4) == a   # a partial last block is not hashed


def test_prefix_cache_matches_the_longest_cached_run_from_the_start():
    cache, hashes = PrefixCache(), block_hashes(list(range(40)), 8)   # 5 blocks
    for h, block in zip(hashes[:3], [11, 12, 13]):
        assert cache.insert(h, block)
    assert not cache.insert(hashes[0], 99)                        # the first copy stays
    assert cache.match(hashes) == [11, 12, 13]
    assert cache.match(block_hashes([0] + list(range(1, 40)), 8)) == [11, 12, 13]
    assert cache.match(block_hashes([1] + list(range(1, 40)), 8)) == []


def test_unused_cached_blocks_are_evicted_least_recently_released_first():
    cache = PrefixCache()
    manager = BlockManager(4, cache)
    blocks = [manager.allocate() for _ in range(4)]
    for i, block in enumerate(blocks):
        cache.insert(bytes([i]), block)
    for block in [blocks[2], blocks[0], blocks[3], blocks[1]]:    # release order = LRU order
        manager.release(block)
    assert manager.num_free == 4 and len(cache) == 4
    manager.share(blocks[0])                                      # a hit: no longer evictable
    assert [manager.allocate() for _ in range(3)] == [blocks[2], blocks[3], blocks[1]]
    assert len(cache) == 1 and cache.match([bytes([0])]) == [blocks[0]]
    with pytest.raises(MemoryError):
        manager.allocate()


# ---- block-manager invariants, property-based ---------------------------------------------------

# An operation: (kind, sequence slot, size). Sequences draw prompts from a few shared prefixes so
# that prefix hits, sharing and eviction all happen.
OPS = st.lists(st.tuples(st.sampled_from(["admit", "grow", "finish"]), st.integers(0, 5), st.integers(1, 40)),
               min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=OPS, n_blocks=st.integers(2, 24))
def test_block_manager_invariants_hold_under_random_traffic(ops, n_blocks):
    bs, cache = 4, PrefixCache()
    manager = BlockManager(n_blocks, cache)
    prefixes = [list(range(100 * p, 100 * p + 40)) for p in range(3)]
    live: dict[int, tuple[list[int], list[int]]] = {}              # slot -> (tokens, block table)
    parked: list[int] = []                                        # the LRU order the test expects
    for kind, slot, size in ops:
        if kind == "admit" and slot not in live:
            tokens = prefixes[slot % 3][:size] + [1000 + slot] * (size // 3)
            hashes = block_hashes(tokens, bs)[:(len(tokens) - 1) // bs]
            table = cache.match(hashes)
            need = -(-len(tokens) // bs) - len(table)
            if need > manager.num_free - sum(manager.refcount[b] == 0 for b in table):
                continue
            for b in table:
                manager.share(b)
                if b in parked:
                    parked.remove(b)
            table += [_allocate(manager, cache, parked) for _ in range(need)]
            for h, b in zip(block_hashes(tokens, bs), table):      # full blocks become findable
                cache.insert(h, b)
            live[slot] = (tokens, table)
        elif kind == "grow" and slot in live and manager.num_free > 0:
            live[slot][1].append(_allocate(manager, cache, parked))
        elif kind == "finish" and slot in live:
            table = live.pop(slot)[1]
            released = list(reversed(table))
            manager.release_all(table)
            parked += [b for b in released if manager.refcount[b] == 0 and cache.holds(b)]
        _check_invariants(manager, cache, live, parked)
    for slot in list(live):
        manager.release_all(live.pop(slot)[1])
    assert all(r == 0 for r in manager.refcount)                  # refcounts return to zero
    assert sorted(manager.free + list(cache.unused)) == list(range(n_blocks))   # every block freed or cached


def _allocate(manager, cache, parked):
    evicting = not manager.free
    block = manager.allocate()
    if evicting:
        assert block == parked.pop(0), "evicted a cached block out of LRU order"
    return block


def _check_invariants(manager, cache, live, parked):
    owners = {}
    for _, table in live.values():
        for b in table:
            owners[b] = owners.get(b, 0) + 1
    for b in range(manager.num_blocks):
        assert manager.refcount[b] == owners.get(b, 0)            # refcount = number of tables holding it
        states = [b in manager.free, manager.refcount[b] > 0, b in cache.unused]
        assert sum(states) == 1, f"block {b} is in {states} (free, used, cached-unused)"
    for b, n in owners.items():
        assert n == 1 or cache.holds(b), f"block {b} is owned {n} times but is no shared cached prefix"
    assert list(cache.unused) == parked
