"""minillm's forward pass equals HF transformers' on the same random weights, position by position."""
import numpy as np
import pytest

import minillm
from hf_models import hf_logits, llama_config, mistral_config, save_random_model

TOL = 1e-4

CASES = {
    "llama-gqa": lambda: llama_config(n_heads=8, n_kv_heads=2),
    "llama-mha": lambda: llama_config(n_heads=4, n_kv_heads=4),
    "llama-mqa": lambda: llama_config(n_heads=8, n_kv_heads=1),
    "llama-tied": lambda: llama_config(n_heads=4, n_kv_heads=2, tied=True),
    "llama-head-dim": lambda: llama_config(n_heads=4, n_kv_heads=2, head_dim=32),
    "mistral-window": lambda: mistral_config(sliding_window=6),
    "llama3-rope-scaling": lambda: llama_config(
        n_heads=8, n_kv_heads=2, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_random_model(CASES[request.param](), path)
    return hf, minillm.load(str(path))


def _ids(n=24, vocab=320, seed=1):
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def test_prefill_logits_match_hf_at_every_position(pair):
    hf, llm = pair
    ids = _ids()
    np.testing.assert_allclose(llm.logits(ids), hf_logits(hf, ids), atol=TOL, rtol=0)


def test_decode_through_kv_cache_matches_hf(pair):
    hf, llm = pair
    ids = _ids()
    expected = hf_logits(hf, ids)
    cache = llm.model.new_cache(len(ids))
    first = llm.model.prefill(ids[:5], cache)
    stepped = [first] + [llm.model.decode(t, cache) for t in ids[5:]]
    np.testing.assert_allclose(np.stack(stepped[1:]), expected[5:], atol=TOL, rtol=0)
    np.testing.assert_allclose(first, expected[4], atol=TOL, rtol=0)


def test_chunked_prefill_matches_one_pass(pair):
    hf, llm = pair
    ids = _ids(40)
    whole = llm.logits(ids)
    model = llm.model.with_options(prefill_chunk=16)
    chunked = model.prefill(ids, model.new_cache(len(ids)), all_logits=True)
    np.testing.assert_allclose(chunked, whole, atol=1e-5, rtol=0)


def test_sliding_window_changes_the_answer(tmp_path):
    """The window test above would pass vacuously if the window were never applied."""
    windowed = minillm.load(str(tmp_path / "w")) if save_random_model(mistral_config(6), tmp_path / "w") else None
    full = minillm.load(str(tmp_path / "f")) if save_random_model(mistral_config(None), tmp_path / "f") else None
    ids = _ids(20)
    a, b = windowed.logits(ids), full.logits(ids)
    np.testing.assert_allclose(a[:6], b[:6], atol=1e-5)      # inside the window: identical
    assert np.abs(a[6:] - b[6:]).max() > 1e-3                 # beyond it: different


def test_storage_dtypes_widen_to_the_same_model(tmp_path):
    save_random_model(llama_config(), tmp_path)
    ids = _ids()
    ref = minillm.load(str(tmp_path)).logits(ids)
    for dtype, tol in [("float16", 2e-2), ("bfloat16", 1e-1)]:
        got = minillm.load(str(tmp_path), dtype=dtype).logits(ids)
        assert np.abs(got - ref).max() < tol, dtype


@pytest.mark.parametrize("prefill_len,chunk", [(3, 512), (10, 512), (13, 4), (13, 9)])
def test_rolling_buffer_cache_matches_hf_with_memory_bounded_by_the_window(tmp_path, prefill_len, chunk):
    """Mistral's sliding window as a rolling buffer: the cache holds W slots, yet every logit
    equals HF's full computation with a windowed mask, through prefill (chunked or not) and decode."""
    from minillm.model.kv_cache import RollingKVCache
    window = 6
    hf = save_random_model(mistral_config(sliding_window=window), tmp_path)
    llm = minillm.load(str(tmp_path))
    ids = _ids(30)
    expected = hf_logits(hf, ids)
    cache = llm.model.new_cache(len(ids))
    assert isinstance(cache, RollingKVCache) and cache.k.shape[2] == window
    got = [llm.model.with_options(prefill_chunk=chunk).prefill(ids[:prefill_len], cache, all_logits=True)]
    got += [llm.model.decode(t, cache)[None] for t in ids[prefill_len:]]
    np.testing.assert_allclose(np.concatenate(got), expected, atol=TOL, rtol=0)
    cfg = llm.config
    assert cache.nbytes == 2 * cfg.n_layers * cfg.n_kv_heads * window * cfg.head_dim * 4


def _last_row_matches_all_rows(model, ids):
    """prefill's default (the last position's logits) runs the last layer's attention, o and MLP for that row
    alone: the same logits as the last of all positions, and a cache the next decode step agrees with."""
    full_cache, last_cache = model.new_cache(len(ids) + 1), model.new_cache(len(ids) + 1)
    full = model.prefill(ids, full_cache, all_logits=True)
    last = model.prefill(ids, last_cache)
    np.testing.assert_allclose(last, full[-1], atol=1e-5, rtol=0)
    np.testing.assert_allclose(model.decode(7, last_cache), model.decode(7, full_cache), atol=1e-5, rtol=0)


def test_prefill_runs_the_last_layer_for_the_last_row_only(pair):
    hf, llm = pair
    _last_row_matches_all_rows(llm.model, _ids(30))       # mistral-window: 30 tokens through a rolling buffer


@pytest.mark.parametrize("options", [dict(kv_cache="int8"), dict(quant="int4", group_size=32),
                                     dict(flashnorm=True)], ids=["int8-kv", "int4", "flashnorm"])
def test_last_row_prefill_with_other_caches_and_weights(tmp_path, options):
    save_random_model(llama_config(n_heads=8, n_kv_heads=2), tmp_path)
    _last_row_matches_all_rows(minillm.load(str(tmp_path), **options).model, _ids(30))
