"""Multi-head latent attention: HF DeepseekV3 parity (naive and absorbed), the latent cache, and the
GQA -> MLA conversion by SVD."""
import json

import numpy as np
import pytest

import minillm
from hf_models import SMALL, hf_logits, llama_config, save_random_model
from minillm.model.config import ModelConfig
from minillm.model.kv_cache import MLACache
from minillm.checkpoints.mla_convert import convert_to_mla, rank_sweep
from minillm.model.transformer import Transformer
from minillm.checkpoints.weights import load_hf_dir, save_hf_dir

TOL = 1e-4
MODES = ["absorbed", "naive"]


def deepseek_config(**extra):
    """A small all-dense DeepseekV3. initializer_range 0.1 (not 0.02) makes attention peaked enough
    that a RoPE-layout mistake moves the logits by ~1, not ~1e-3."""
    from transformers import DeepseekV3Config
    return DeepseekV3Config(**(SMALL | dict(
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=SMALL["num_hidden_layers"],
        rms_norm_eps=1e-5, initializer_range=0.1) | extra))


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 0.8, "mscale_all_dim": 0.6, "beta_fast": 32, "beta_slow": 1}

CASES = {
    "q-lora": lambda: deepseek_config(),
    "no-q-lora": lambda: deepseek_config(q_lora_rank=None),
    "half-split-rope": lambda: deepseek_config(rope_interleave=False),
    "yarn": lambda: deepseek_config(rope_parameters=YARN, max_position_embeddings=64),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_random_model(CASES[request.param](), path)
    return hf, minillm.load(str(path)), path


def _ids(n=24, vocab=320, seed=1):
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


@pytest.mark.parametrize("mode", MODES)
def test_mla_prefill_matches_hf_logits(pair, mode):
    hf, llm, _ = pair
    llm = llm.with_options(mla_mode=mode)
    ids = _ids()
    np.testing.assert_allclose(llm.logits(ids), hf_logits(hf, ids), atol=TOL, rtol=0)


@pytest.mark.parametrize("mode", MODES)
def test_mla_decode_through_latent_cache_matches_hf(pair, mode):
    hf, llm, _ = pair
    llm = llm.with_options(mla_mode=mode)
    ids = _ids()
    expected = hf_logits(hf, ids)
    cache = llm.model.new_cache(len(ids))
    assert isinstance(cache, MLACache)
    first = llm.model.prefill(ids[:5], cache)
    stepped = np.stack([llm.model.decode(t, cache) for t in ids[5:]])
    np.testing.assert_allclose(first, expected[4], atol=TOL, rtol=0)
    np.testing.assert_allclose(stepped, expected[5:], atol=TOL, rtol=0)


def test_naive_equals_absorbed_and_chunking(pair):
    _, llm, _ = pair
    ids = _ids(40)
    model = llm.model
    out = {}
    for mode in MODES:
        out[mode] = model.with_options(mla_mode=mode).prefill(ids, model.new_cache(len(ids)), all_logits=True)
    np.testing.assert_allclose(out["naive"], out["absorbed"], atol=1e-5, rtol=0)
    chunked = model.with_options(mla_mode="naive", prefill_chunk=16).prefill(ids, model.new_cache(len(ids)),
                                                                             all_logits=True)
    np.testing.assert_allclose(chunked, out["naive"], atol=1e-5, rtol=0)


def test_params_and_config_round_trip_through_hf(pair, tmp_path):
    """n_params counts what HF builds; to_hf() writes a config HF loads back to the same model."""
    hf, llm, path = pair
    assert llm.config.n_params == sum(p.numel() for p in hf.parameters())
    from transformers import AutoModelForCausalLM
    _, tensors = load_hf_dir(path)
    save_hf_dir(tmp_path, llm.config, tensors)
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = _ids()
    np.testing.assert_allclose(hf_logits(again, ids), hf_logits(hf, ids), atol=1e-6, rtol=0)
    assert ModelConfig.from_hf(json.loads((tmp_path / "config.json").read_text())) == llm.config


def test_latent_cache_bytes_follow_the_formula(pair):
    _, llm, _ = pair
    c = llm.config
    per_token = c.n_layers * (c.kv_lora_rank + c.qk_rope_head_dim)      # c_KV and k_rope, nothing per head
    assert c.kv_bytes_per_token(2) == 2 * per_token
    assert llm.model.new_cache(100).nbytes == 100 * c.kv_bytes_per_token(4)
    mha = c.n_layers * c.n_heads * (c.head_dim + c.v_head_dim)          # the K and V it expands to
    assert per_token * 4 <= mha


def test_deepseek_with_moe_layers_reads_its_experts():   # (their HF parity: test_moe.py)
    d = deepseek_config(first_k_dense_replace=1).to_dict() | {"architectures": ["DeepseekV3ForCausalLM"]}
    c = ModelConfig.from_hf(d)
    assert c.attention == "mla" and c.n_experts == d["n_routed_experts"] and c.n_moe_layers == 2


# ---- GQA -> MLA by SVD -----------------------------------------------------------------------------

LLAMAS = {
    "gqa": lambda: llama_config(n_heads=8, n_kv_heads=2, initializer_range=0.1),
    "llama3-tied": lambda: llama_config(
        n_heads=8, n_kv_heads=4, tied=True, initializer_range=0.1, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
}


@pytest.fixture(scope="module", params=sorted(LLAMAS))
def llama(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_random_model(LLAMAS[request.param](), path)
    return load_hf_dir(path)


@pytest.mark.parametrize("mode", MODES)
def test_svd_conversion_at_full_rank_reproduces_the_llama(llama, mode):
    config, tensors = llama
    ids = _ids()
    ref = Transformer(config, tensors)
    expected = ref.prefill(ids, ref.new_cache(len(ids)), all_logits=True)
    mla_config, mla_tensors = convert_to_mla(config, tensors, kv_rank=config.n_kv_heads * config.head_dim)
    model = Transformer(mla_config, mla_tensors, mla_mode=mode)
    np.testing.assert_allclose(model.prefill(ids, model.new_cache(len(ids)), all_logits=True),
                               expected, atol=TOL, rtol=0)
    cache = model.new_cache(len(ids))
    model.prefill(ids[:5], cache)
    stepped = np.stack([model.decode(t, cache) for t in ids[5:]])
    np.testing.assert_allclose(stepped, expected[5:], atol=TOL, rtol=0)
    assert mla_config.kv_bytes_per_token() == config.kv_bytes_per_token()   # full rank saves nothing


def test_svd_error_falls_as_rank_grows(llama):
    config, tensors = llama
    full = config.n_kv_heads * config.head_dim
    rows = rank_sweep(config, tensors, _ids(), [full // 8, full // 2, 3 * full // 4, full])
    errors = [r["rel_rms_err"] for r in rows]
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 1e-5
    sizes = [r["bytes_per_token"] for r in rows]
    assert sizes == sorted(sizes) and sizes[0] < config.kv_bytes_per_token()
    # Fewer shared RoPE key heads: a smaller cache, at a cost.
    keyed = rank_sweep(config, tensors, _ids(), [full], key_ranks=[1, None])
    assert keyed[0]["bytes_per_token"] < keyed[1]["bytes_per_token"]
    assert keyed[0]["rel_rms_err"] > 1e-3 > keyed[1]["rel_rms_err"]
