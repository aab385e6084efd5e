"""Weight quantization (int8 per channel, int4 in packed groups) and the int8 KV cache."""
import json

import numpy as np
import pytest

import minillm
from hf_models import llama_config, save_random_model
from minillm.checkpoints import quantize
from minillm.checkpoints.convert import convert
from minillm.model import quant, quantized
from minillm.backend import f32_to_bf16
from minillm.errors import MiniLLMError
from minillm.model.kv_cache import Int8KVCache
from minillm.model.layers import linear

SHAPES = [(64, 128), (33, 100), (5, 257)]       # the last two do not divide into groups


def _matrix(shape, seed=0):
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    w[0, :3] = [4.0, -3.0, 0.0]                  # an outlier, as real weights have
    return w


def _ids(n=24, vocab=320, seed=1):
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


# ---- one matrix --------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
def test_int8_error_is_at_most_half_a_step(shape):
    w = _matrix(shape)
    q = quant.quantize_int8(w)
    assert q.qweight.dtype == np.int8 and q.qweight.shape == shape and q.scales.shape == (shape[0],)
    assert np.abs(q.qweight).max() == 127
    np.testing.assert_allclose(q.scales, np.abs(w).max(axis=1) / 127, rtol=1e-6)
    assert np.all(np.abs(q.dequantize() - w) <= q.scales[:, None] / 2 * (1 + 1e-5))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_error_is_at_most_half_a_step(shape, group_size):
    w = _matrix(shape)
    q = quant.quantize_int4(w, group_size)
    n_groups = -(-shape[1] // group_size)
    assert q.group_size == group_size and q.shape == shape
    assert q.scales.dtype == q.mins.dtype == np.float16 and q.scales.shape == (shape[0], n_groups)
    step = np.repeat(q.scales.astype(np.float32), group_size, axis=1)[:, :shape[1]]
    w_hat = q.dequantize()
    assert w_hat.shape == shape                                  # padding columns are dropped
    assert np.all(np.abs(w_hat - w) <= step / 2 * (1 + 1e-3) + 1e-6)


def _grid_bounds(q):
    """Per element of a quantized matrix: its group's step, lowest and highest grid value (fp32)."""
    n_in = q.shape[1]
    expand = lambda a: np.repeat(a.astype(np.float32), q.group_size, axis=1)[:, :n_in]
    step, low = expand(q.scales), expand(q.mins)
    return step, low, low + 15 * step


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("weighted", [False, True])
def test_searched_int4_error_is_half_a_step_inside_its_grid_plus_the_clipped_distance(shape, group_size, weighted):
    """The search may clip: a weight outside [min, min + 15·scale] lands on the nearest end, so its
    error is its distance to that end; inside, at most half a step, as with min/max."""
    w = _matrix(shape)
    importance = np.random.default_rng(3).gamma(0.3, size=shape[1]) if weighted else None
    q = quant.quantize_int4(w, group_size, search=True, importance=importance)
    assert q.scales.dtype == q.mins.dtype == np.float16 and q.shape == shape
    step, low, high = _grid_bounds(q)
    clipped = np.maximum(0, np.maximum(low - w, w - high))
    error = np.abs(q.dequantize() - w)
    assert np.all(error <= step / 2 * (1 + 1e-3) + clipped + 1e-6)
    assert np.all(error >= clipped - 1e-6)                       # nothing outside the grid is represented


def _group_errors(q, w, importance):
    """Σ importance·error² per (row, group).   -> [out, groups]"""
    padded = -w.shape[1] % q.group_size
    sq = np.pad((q.dequantize() - w) ** 2 * importance, ((0, 0), (0, padded)))
    return sq.reshape(w.shape[0], -1, q.group_size).sum(-1)


@pytest.mark.parametrize("group_size", [32, 128])
def test_int4_search_never_loses_to_min_max_and_usually_wins(group_size):
    w = _matrix((48, 257), seed=4)
    importance = np.random.default_rng(5).gamma(0.3, size=257).astype(np.float32)
    plain = _group_errors(quant.quantize_int4(w, group_size), w, importance)
    searched = _group_errors(quant.quantize_int4(w, group_size, search=True, importance=importance), w, importance)
    assert np.all(searched <= plain * (1 + 1e-5) + 1e-9)      # group by group
    assert searched.sum() < 0.8 * plain.sum()                    # measured 0.44 (g32) and 0.62 (g128)


def test_int4_search_spends_its_levels_where_the_importance_is():
    w = _matrix((256, 128), seed=6)
    importance = np.ones(128, np.float32)
    importance[7] = 1000.0                                       # one input column matters 1000× more
    column_rms = lambda q: float(np.sqrt(((q.dequantize() - w)[:, 7] ** 2).mean()))
    uniform = column_rms(quant.quantize_int4(w, 128, search=True))
    focused = column_rms(quant.quantize_int4(w, 128, search=True, importance=importance))
    assert focused < 0.1 * uniform                               # measured 0.013


def test_int4_quantizes_bf16_and_fp16_like_their_fp32_values():
    w = _matrix((16, 96))
    bits = f32_to_bf16(w)
    from minillm.backend import bf16_to_f32
    a, b = quant.quantize_int4(bits, 32), quant.quantize_int4(bf16_to_f32(bits), 32)
    assert np.array_equal(a.qweight, b.qweight) and np.array_equal(a.scales, b.scales)
    h = quant.quantize_int8(w.astype(np.float16))
    assert np.array_equal(h.qweight, quant.quantize_int8(w.astype(np.float16).astype(np.float32)).qweight)


def test_int4_packing_is_the_documented_layout():
    q = np.array([[1, 2, 3, 4, 15, 0], [0, 15, 7, 8, 9, 10]], dtype=np.uint8)
    packed = quant.pack_int4(q)
    assert packed.tolist() == [[0x21, 0x43, 0x0F], [0xF0, 0x87, 0xA9]]   # element 2j low, 2j+1 high
    codes = np.random.default_rng(0).integers(0, 16, (7, 256), dtype=np.uint8)
    assert np.array_equal(quant.unpack_int4(quant.pack_int4(codes)), codes)


def test_int4_codes_and_padding_in_the_stored_bytes():
    w = _matrix((5, 257))
    q = quant.quantize_int4(w, 128)
    assert q.qweight.dtype == np.uint8 and q.qweight.shape == (5, 3 * 128 // 2)
    assert q.qweight.shape[1] % 16 == 0                          # every row starts 16-byte aligned
    codes = quant.unpack_int4(q.qweight).reshape(5, 3, 128)      # [rows, groups, g]
    s, m = q.scales.astype(np.float32)[..., None], q.mins.astype(np.float32)[..., None]
    assert np.array_equal((codes * s + m).reshape(5, -1)[:, :257], q.dequantize())
    assert np.all(codes[:, 2, 1:] == codes[:, 2, :1])            # padding repeats the row's last weight
    assert codes.min() == 0 and codes.max() == 15                # the grid spans each group's range


def test_zero_rows_and_constant_groups_stay_exact():
    w = np.zeros((4, 64), np.float32)
    w[1] = 0.25
    assert np.array_equal(quant.quantize_int8(w).dequantize(), w)
    assert np.array_equal(quant.quantize_int4(w, 32).dequantize(), w)


def test_group_size_must_be_a_multiple_of_32():
    with pytest.raises(MiniLLMError, match="multiple of 32"):
        quant.quantize_int4(_matrix((4, 64)), 48)


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("n_tokens", [1, 3, 64, 200])   # int4: by groups below the group size, widened above
def test_quantized_linear_equals_dequantize_then_matmul(method, n_tokens, monkeypatch):
    w = quantized.quantize(_matrix((300, 257)), method, 64)
    x = np.random.default_rng(2).standard_normal((n_tokens, 257)).astype(np.float32)
    expected = x @ w.dequantize().T
    monkeypatch.setattr(quant, "BLOCK_BYTES", 40 * 257 * 4)      # 40 rows a block: 8 blocks, a short last one
    # the same products, summed in another order (by blocks, by groups, scale after the sum): fp32 rounding only
    np.testing.assert_allclose(linear(x, w), expected, rtol=0, atol=2e-6 * np.abs(expected).max())
    # int8: a byte a weight + an fp32 scale a row; int4: 320 padded columns at half a byte + fp16 scale, min.
    assert w.nbytes == (300 * 257 + 300 * 4 if method == "int8" else 300 * 160 + 2 * 300 * 5 * 2)


# ---- the thread pool the grid search runs on (minillm.threads) ---------------------------------------

def test_parallel_map_keeps_order_and_runs_nested_calls_in_place(monkeypatch):
    import threading

    from minillm.threads import parallel_map
    monkeypatch.setenv("MINILLM_THREADS", "3")
    assert parallel_map(lambda a, b: a * b, range(10), range(10, 20)) == [a * (a + 10) for a in range(10)]

    def inner(_):
        return threading.get_ident(), parallel_map(lambda j: (threading.get_ident(), j), range(4))
    outer = parallel_map(inner, range(6))
    for ident, nested in outer:                                    # a nested map stays on its caller's thread
        assert [j for _, j in nested] == [0, 1, 2, 3] and {t for t, _ in nested} == {ident}


def test_parallel_map_raises_what_a_worker_raised(monkeypatch):
    from minillm.threads import parallel_map
    monkeypatch.setenv("MINILLM_THREADS", "2")

    def fail_on_3(i):
        if i == 3:
            raise ValueError("item 3")
        return i
    with pytest.raises(ValueError, match="item 3"):
        parallel_map(fail_on_3, range(8))


def test_thread_count_follows_minillm_then_blas_settings(monkeypatch):
    from minillm import threads
    from minillm.threads import n_threads
    monkeypatch.setitem(threads._state, "user_threads", None)   # no --threads given (an earlier load may have fixed one)
    for var in ("MINILLM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert n_threads() == 3
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")            # the lessons' single-core timing setting
    assert n_threads() == 1
    monkeypatch.setenv("MINILLM_THREADS", "4")
    assert n_threads() == 4
    monkeypatch.setenv("MINILLM_THREADS", "zero")              # not a count: ignored
    assert n_threads() == 1


# ---- whole models ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_random_model(llama_config(), path)
    return path


def test_int8_logits_stay_close_to_fp32(random_model):
    """HF's init (std 0.02) gives logits of std ~0.16: int8 moves none by more than a tenth of that
    (measured 0.037), ten times less than int4 in groups of 32 does."""
    ids = _ids()
    ref = minillm.load(str(random_model)).logits(ids)
    int8 = minillm.load(str(random_model), quant="int8").logits(ids)
    int4 = minillm.load(str(random_model), quant="int4", group_size=32).logits(ids)
    assert np.abs(int8 - ref).max() < 0.1 * ref.std()
    assert np.abs(int8 - ref).max() < np.abs(int4 - ref).max() / 5


def test_input_importance_is_the_mean_square_of_each_matrix_input(random_model):
    from minillm.model.layers import rmsnorm
    from minillm.checkpoints.reader import read_checkpoint

    config, tensors, _ = read_checkpoint(random_model)
    importance = quantize.input_importance(config, tensors, n_tokens=40, seed=7)
    assert set(importance) == {k for k in tensors if quant.is_layer_matrix(k)}
    # Layer 0's q, k and v all read the normed embeddings of the (random) calibration tokens.
    ids = np.random.default_rng(7).integers(0, config.vocab_size, 40)
    h = rmsnorm(np.asarray(tensors["model.embed_tokens.weight"])[ids],
                tensors["model.layers.0.input_layernorm.weight"], config.norm_eps)   # [40, dim]
    for part in ("q_proj", "k_proj", "v_proj"):
        np.testing.assert_allclose(importance[f"model.layers.0.self_attn.{part}.weight"], (h ** 2).mean(0), rtol=1e-5)
    assert importance["model.layers.2.mlp.down_proj.weight"].shape == (config.ffn_dim,)
    assert np.all(importance["model.layers.2.mlp.down_proj.weight"] > 0)


@pytest.mark.parametrize("method,group_size", [("int8", 128), ("int4", 32)])
def test_save_then_load_is_bit_exact_without_requantizing(random_model, tmp_path, monkeypatch, method, group_size):
    from minillm.checkpoints.reader import read_checkpoint
    from minillm.checkpoints.weights import save_hf_dir

    config, tensors, _ = read_checkpoint(random_model)
    qconfig, qtensors = quantize.quantize_checkpoint(config, tensors, method, group_size)
    save_hf_dir(tmp_path, qconfig, qtensors)
    fresh = minillm.load(str(random_model), quant=method, group_size=group_size)
    ids = _ids()
    expected = fresh.logits(ids)

    def no_requantizing(*a, **k):
        raise AssertionError("a saved quantized checkpoint must not be quantized again")
    monkeypatch.setattr(quantize, "quantize", no_requantizing)      # where quantize_checkpoint looks it up
    assert json.loads((tmp_path / "config.json").read_text())["quantization"] == qconfig.quantization
    stored = minillm.checkpoints.weights.load_hf_dir(tmp_path)[1]
    for name, a in qtensors.items():
        assert stored[name].dtype == a.dtype and np.array_equal(stored[name], a), name
    for kw in [{}, dict(quant=method, group_size=group_size), dict(dtype="bfloat16")]:
        loaded = minillm.load(str(tmp_path), **kw)
        assert isinstance(loaded.model.layers[0].w_up, quant.QuantizedWeight)
        got = loaded.logits(ids)
        if not kw.get("dtype"):
            assert np.array_equal(got, expected)
    other = "int4" if method == "int8" else "int8"
    with pytest.raises(MiniLLMError, match="stored quantized"):
        minillm.load(str(tmp_path), quant=other)


def test_convert_quantized_and_info_count_the_stored_bytes(random_model, tmp_path, monkeypatch):
    from minillm.tools import info

    dst = convert(random_model, tmp_path / "q", quant="int4", group_size=32, progress=False)
    ids = _ids()
    np.testing.assert_array_equal(minillm.load(str(dst)).logits(ids),
                                  minillm.load(str(random_model), quant="int4", group_size=32).logits(ids))
    monkeypatch.setenv("MINILLM_WEIGHTS", str(tmp_path))
    report = info.describe(str(dst))
    stored = sum(a.nbytes for a in minillm.checkpoints.weights.load_hf_dir(dst)[1].values())
    assert "int4, groups of 32" in report and f"{stored / 1e6:.1f} MB" in report


def test_write_random_checkpoint_streams_a_loadable_quantized_model(tmp_path):
    cfg = minillm.PRESETS["smollm2-135m"].config.replace(n_layers=2, vocab_size=512, max_seq_len=64)
    dst = quantize.write_random_checkpoint(cfg, tmp_path, quant="int4", group_size=128)
    llm = minillm.load(str(dst))
    up = llm.model.layers[1].w_up
    assert isinstance(up, quant.Int4Weight) and up.shape == (cfg.ffn_dim, cfg.dim)
    assert llm.model.layers[0].wq.qweight.shape == (cfg.dim, 640 // 2)     # 576 padded to 5 groups of 128
    cache = llm.model.new_cache(8)
    logits = llm.model.prefill([1, 2, 3], cache)
    assert np.isfinite(llm.model.decode(int(np.argmax(logits)), cache)).all()


def test_quantization_rejects_mla_and_unknown_methods(random_model):
    with pytest.raises(MiniLLMError, match="unknown quant"):
        minillm.load(str(random_model), quant="int3")
    mla = minillm.ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=64,
                              attention="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                              v_head_dim=8)
    with pytest.raises(MiniLLMError, match="MLA"):
        quantize.quantize_checkpoint(mla, {}, "int8")


# ---- int8 KV cache -----------------------------------------------------------------------------------
def test_int8_kv_cache_keeps_the_kv_cache_contract():
    cfg = minillm.ModelConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)
    cache = Int8KVCache(cfg, 16)
    rng = np.random.default_rng(0)
    k1, v1 = rng.standard_normal((2, 2, 5, 16)).astype(np.float32)          # [n_kv, T, hd] each
    k2, v2 = rng.standard_normal((2, 2, 1, 16)).astype(np.float32)
    keys, values = cache.append(0, k1, v1)
    assert keys.dtype == np.float32 and keys.shape == (2, 5, 16)
    cache.advance(5)
    keys, values = cache.append(0, k2, v2)
    assert keys.shape == values.shape == (2, 6, 16) and cache.length == 5
    k_all = np.concatenate([k1, k2], axis=1)
    step = np.abs(k_all).max(axis=-1, keepdims=True) / 127                   # one scale per (head, position)
    assert np.all(np.abs(keys - k_all) <= step / 2 * (1 + 1e-5))
    assert cache.nbytes == 2 * (2 * 2 * 16 * 16 + 2 * 2 * 16 * 4)           # int8 values + fp32 scales
    cache.reset()
    assert cache.length == 0
    with pytest.raises(ValueError, match="full"):
        cache.append(1, *rng.standard_normal((2, 2, 17, 16)).astype(np.float32))


def test_int8_kv_cache_decode_matches_its_prefill(random_model):
    llm = minillm.load(str(random_model), kv_cache="int8")
    ids = _ids()
    whole = llm.logits(ids)
    cache = llm.model.new_cache(len(ids))
    assert isinstance(cache, Int8KVCache)
    stepped = [llm.model.prefill(ids[:5], cache)] + [llm.model.decode(t, cache) for t in ids[5:-1]]
    np.testing.assert_allclose(np.stack(stepped), whole[4:-1], atol=2e-3)
    ref = minillm.load(str(random_model)).logits(ids)
    assert np.abs(whole - ref).max() < 0.05 * ref.std()


# ---- the real model: quality on text -----------------------------------------------------------------
@pytest.fixture(scope="module")
def ppl(smollm2_dir):
    """Perplexity over the first 256 tokens of minillm.tools.evaluate's text, for load(**kw)."""
    from minillm.tools.evaluate import eval_text, perplexity

    text = eval_text(2000)
    return lambda **kw: perplexity(minillm.load(str(smollm2_dir), **kw), text, context=256,
                                   max_tokens=256).ppl


@pytest.fixture(scope="module")
def fp32_ppl(ppl):
    return ppl()


@pytest.mark.parametrize("kw,limit", [
    (dict(quant="int8"), 0.01),                                  # measured +0.4%
    (dict(kv_cache="int8"), 0.01),                               # measured -0.02%
    # The issue's bound. Measured +14.0% here, +14.0% over lesson 09's 510 tokens, +13.2% over
    # `minillm eval perplexity`'s 4697; min/max grids gave +56.5 / 64.9 / 53.4% (quant.py's weighted
    # grid search is what brings it down, and the margin is thin: see quant.py). SmolLM2's weights
    # come from a Q4_1 GGUF (4-bit groups of 32), which groups of 128 round a second time.
    # Groups of 64: +8.1%; groups of 32: exact (the test below).
    (dict(quant="int4", group_size=128), 0.15),
])
def test_smollm2_perplexity_stays_close_to_fp32(ppl, fp32_ppl, kw, limit):
    assert ppl(**kw) <= fp32_ppl * (1 + limit)


@pytest.mark.parametrize("search", [False, True])
def test_smollm2_int4_in_groups_of_32_recovers_its_q4_1_weights_exactly(smollm2_dir, search):
    """Q4_1 is asymmetric 4-bit in groups of 32 with fp16 scale and min: our int4-g32 grid is the
    same grid, so quantizing the dequantized GGUF weights gives them back bit for bit (the search
    keeps min/max's grid wherever nothing beats it, and nothing beats an exact fit)."""
    from minillm.checkpoints.weights import load_hf_dir
    _, tensors = load_hf_dir(smollm2_dir)
    w = tensors["model.layers.0.mlp.up_proj.weight"]
    assert np.array_equal(quant.quantize_int4(w, 32, search=search).dequantize(), w)
