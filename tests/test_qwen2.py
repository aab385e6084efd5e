"""Biases: Qwen2 (q/k/v), Llama's attention_bias (q/k/v/o) and mlp_bias (gate/up/down) match HF
transformers on random small models, through prefill, the KV cache, quantization and the batched engine."""
import json

import numpy as np
import pytest

import minillm
from hf_models import hf_logits, llama_config, qwen2_config, save_random_model
from minillm.engine.engine import Engine
from minillm.engine.generate import generate_ids
from minillm.engine.sampling import SamplingParams
from minillm.errors import MiniLLMError

TOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def _one_blas_thread():
    """Every load would time BLAS thread counts first (~0.3 s); these tests load tiny models many times."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINILLM_THREADS", "1")
        yield

CASES = {
    "qwen2-gqa": lambda: qwen2_config(n_heads=8, n_kv_heads=2),
    "qwen2-tied-mha": lambda: qwen2_config(n_heads=4, n_kv_heads=4, tied=True),
    "llama-attention-bias": lambda: llama_config(n_heads=8, n_kv_heads=2, attention_bias=True),
    "llama-mlp-bias": lambda: llama_config(n_heads=4, n_kv_heads=2, mlp_bias=True),
    "llama-all-biases": lambda: llama_config(n_heads=4, n_kv_heads=1, attention_bias=True, mlp_bias=True),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_random_model(CASES[request.param](), path)
    return hf, minillm.load(str(path)), path


def _ids(n=20, vocab=320, seed=1):
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def test_bias_models_match_hf_logits_at_every_position(pair):
    hf, llm, _ = pair
    ids = _ids()
    np.testing.assert_allclose(llm.logits(ids), hf_logits(hf, ids), atol=TOL, rtol=0)


def test_bias_models_decode_through_the_kv_cache_like_hf(pair):
    hf, llm, _ = pair
    ids = _ids()
    expected = hf_logits(hf, ids)
    cache = llm.model.new_cache(len(ids))
    llm.model.prefill(ids[:6], cache)
    stepped = np.stack([llm.model.decode(t, cache) for t in ids[6:]])
    np.testing.assert_allclose(stepped, expected[6:], atol=TOL, rtol=0)


def test_the_biases_matter(pair):
    """Zeroing the biases changes the logits: the parity above is not a bias-free model's."""
    hf, _, path = pair
    llm, ids = minillm.load(str(path)), _ids(8)
    assert all(layer.bias for layer in llm.model.layers)
    for layer in llm.model.layers:
        layer.bias = {}
    assert np.abs(llm.logits(ids) - hf_logits(hf, ids)).max() > 10 * TOL


def test_qwen2_config_round_trips(tmp_path):
    from minillm.model.config import ModelConfig
    save_random_model(qwen2_config(), tmp_path)
    config = ModelConfig.from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert (config.family, config.qkv_bias, config.o_bias, config.mlp_bias) == ("qwen2", True, False, False)
    assert ModelConfig.from_hf(config.to_hf()) == config


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_bias_model_stays_close_to_float(tmp_path, quant):
    """Quantizing touches the matrices only: the biases load as they were."""
    save_random_model(qwen2_config(n_heads=4, n_kv_heads=2, hidden_size=128), tmp_path)
    ids = _ids(8)
    exact = minillm.load(str(tmp_path)).logits(ids)
    approx = minillm.load(str(tmp_path), quant=quant, group_size=32).logits(ids)
    assert np.abs(approx - exact).max() < 0.1 * np.abs(exact).max()


def test_convert_keeps_the_biases(tmp_path):
    from minillm.checkpoints.convert import convert
    hf = save_random_model(llama_config(attention_bias=True, mlp_bias=True), tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "dst", progress=False, dtype="float32")
    ids = _ids(8)
    np.testing.assert_allclose(minillm.load(str(tmp_path / "dst")).logits(ids), hf_logits(hf, ids), atol=TOL, rtol=0)


def test_flashnorm_with_biases_is_refused_in_one_line(tmp_path):
    save_random_model(qwen2_config(), tmp_path)
    with pytest.raises(MiniLLMError, match="flashnorm is not implemented for models with biases"):
        minillm.load(str(tmp_path), flashnorm=True)


def test_batched_engine_equals_generate_on_a_bias_model(tmp_path):
    """The engine runs the Transformer's own qkv()/ffn() and o projection: the biases reach it."""
    save_random_model(llama_config(n_heads=8, n_kv_heads=2, attention_bias=True, mlp_bias=True,
                                   eos_token_id=None), tmp_path)
    llm = minillm.load(str(tmp_path))
    prompts = [_ids(n, seed=n) for n in (3, 17, 9)]
    alone = [generate_ids(llm.model, p, 12, SamplingParams()).token_ids for p in prompts]
    batched = Engine(llm, max_batch_tokens=8).generate(prompts, max_tokens=12)
    assert [r.token_ids for r in batched] == alone


def test_qwen2_with_every_layer_windowed_matches_hf(tmp_path):
    """use_sliding_window with max_window_layers=0 windows every layer: Mistral's mask, which minillm has."""
    hf = save_random_model(qwen2_config(use_sliding_window=True, sliding_window=5, max_window_layers=0), tmp_path)
    llm = minillm.load(str(tmp_path))
    assert llm.config.sliding_window == 5
    ids = _ids(16)
    np.testing.assert_allclose(llm.logits(ids), hf_logits(hf, ids), atol=TOL, rtol=0)


def test_qwen2_with_some_layers_windowed_is_refused(tmp_path):
    save_random_model(qwen2_config(use_sliding_window=True, sliding_window=5, max_window_layers=1), tmp_path)
    with pytest.raises(MiniLLMError, match="layer_types mixes sliding and full attention"):
        minillm.load(str(tmp_path))


def test_converting_a_bias_model_to_mla_is_refused(tmp_path):
    """The latent attention has no biases: a converted Qwen2 would have dropped them without a word."""
    from minillm.checkpoints.mla_convert import convert_to_mla
    from minillm.checkpoints.weights import load_hf_dir
    save_random_model(qwen2_config(n_heads=4, n_kv_heads=2), tmp_path)
    config, tensors = load_hf_dir(tmp_path)
    with pytest.raises(ValueError, match="attention biases are not implemented for MLA"):
        convert_to_mla(config, tensors, kv_rank=32)
