"""Sparse mixture of experts: HF parity for random Mixtral and DeepSeek-V3 (MoE + MLA, shared experts,
group-limited routing) through prefill, prefill + decode, greedy generation and the Engine; the router
against a dense reference; sparse dispatch equals running every expert."""
import json

import numpy as np
import pytest
import torch

import minillm
from hf_models import SMALL, hf_logits
from minillm.model.config import ModelConfig
from minillm.model.moe import Expert, MoEWeights, limit_to_groups, moe_block, route

TOL = 1e-4


def mixtral_config(**extra):
    from transformers import MixtralConfig
    return MixtralConfig(**(SMALL | dict(num_attention_heads=8, num_key_value_heads=2, num_local_experts=4,
                                         num_experts_per_tok=2, initializer_range=0.1) | extra))


def deepseek_moe_config(**extra):
    """MLA + MoE: layer 0 dense, layers 1-2 MoE with 8 experts in 4 groups (2 eligible), top-3, a shared expert."""
    from transformers import DeepseekV3Config
    return DeepseekV3Config(**(SMALL | dict(
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=3,
        n_group=4, topk_group=2, moe_intermediate_size=32, n_shared_experts=1, routed_scaling_factor=2.5,
        rms_norm_eps=1e-5, initializer_range=0.1) | extra))


def save_moe_model(config, path, seed=0):
    """A random HF MoE model, with norm gains, router weights and DeepSeek's correction bias made to matter."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("gate.weight"):               # the router: spread the scores
                p.copy_(0.3 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    model.save_pretrained(path)
    return model


CASES = {"mixtral": mixtral_config, "deepseek": deepseek_moe_config}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_moe_model(CASES[request.param](), path)
    return hf, minillm.load(str(path)), path


def _ids(n=20, seed=1):
    return np.random.default_rng(seed).integers(0, SMALL["vocab_size"], n).tolist()


def test_moe_config_reads_hf(pair):
    _, llm, path = pair
    c = llm.config
    assert c.n_experts in (4, 8) and c.n_moe_layers == (3 if c.family == "mixtral" else 2)
    assert c.n_active_params < c.n_params
    again = ModelConfig.from_hf(c.to_hf())                      # to_hf writes what from_hf reads back
    assert again == c.replace(torch_dtype=again.torch_dtype)


def test_moe_prefill_matches_hf_logits(pair):
    hf, llm, _ = pair
    ids = _ids()
    np.testing.assert_allclose(llm.logits(ids), hf_logits(hf, ids), atol=TOL, rtol=0)


def test_moe_prefill_then_decode_matches_hf(pair):
    hf, llm, _ = pair
    ids = _ids()
    expected = hf_logits(hf, ids)
    cache = llm.model.new_cache(len(ids))
    first = llm.model.prefill(ids[:6], cache)
    stepped = np.stack([llm.model.decode(t, cache) for t in ids[6:]])
    np.testing.assert_allclose(first, expected[5], atol=TOL, rtol=0)
    np.testing.assert_allclose(stepped, expected[6:], atol=TOL, rtol=0)


def test_moe_greedy_equals_hf_generate(pair):
    hf, llm, _ = pair
    prompt = _ids(8, seed=3)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    from minillm.engine.generate import generate_ids
    from minillm.engine.sampling import SamplingParams
    g = generate_ids(llm.model, prompt, 8, SamplingParams(0.0), stop_ids=set())
    assert g.token_ids == out


def test_mixtral_through_engine_matches_generate(pair):
    hf, llm, _ = pair
    if llm.config.attention != "gqa":
        pytest.skip("the batching engine runs GQA attention (MLA: llm.generate, tested above)")
    from minillm.engine.engine import Engine
    from minillm.engine.generate import generate_ids
    from minillm.engine.sampling import SamplingParams
    prompts = [_ids(7, seed=s) for s in (4, 5)]
    outs = Engine(llm).generate(prompts, max_tokens=6)
    for prompt, got in zip(prompts, outs):
        ref = generate_ids(llm.model, prompt, 6, SamplingParams(0.0), stop_ids=set(llm.config.eos_token_ids))
        assert got.token_ids == ref.token_ids


# ---- the router and the sparse dispatch, against dense references ---------------------------------
def _random_moe(rng, cfg, shared=False):
    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32) * 0.2
    experts = [Expert(w(cfg.moe_ffn_dim, cfg.dim), w(cfg.moe_ffn_dim, cfg.dim), w(cfg.dim, cfg.moe_ffn_dim))
               for _ in range(cfg.n_experts)]
    shared_expert = Expert(w(32, cfg.dim), w(32, cfg.dim), w(cfg.dim, 32)) if shared else None
    return MoEWeights(router=w(cfg.n_experts, cfg.dim), experts=experts, bias=w(cfg.n_experts), shared=shared_expert)


def _moe_cfg(**kw):
    base = dict(vocab_size=8, dim=16, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=8, n_experts=8,
                n_experts_per_token=2, moe_ffn_dim=12)
    return ModelConfig(**(base | kw))


def test_softmax_router_picks_top_k_and_renormalizes():
    rng = np.random.default_rng(0)
    cfg = _moe_cfg()
    moe = _random_moe(rng, cfg)
    h = rng.standard_normal((30, cfg.dim)).astype(np.float32)
    ids, weights = route(h, moe, cfg)
    logits = h @ moe.router.T
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    expected = np.argsort(-probs, axis=-1)[:, :2]
    assert (np.sort(ids, -1) == np.sort(expected, -1)).all()
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(weights, np.take_along_axis(probs, ids, -1) /
                               np.take_along_axis(probs, ids, -1).sum(-1, keepdims=True), rtol=1e-6)


def test_group_limit_keeps_the_best_groups_by_top2_sum():
    choice = np.array([[0.9, 0.0, 0.1, 0.1, 0.5, 0.5, 0.2, 0.8]], np.float32)   # groups of 2: sums .9 .2 1.0 1.0
    out = limit_to_groups(choice, n_groups=4, keep=2)
    assert np.isinf(out[0, :4]).all() and (out[0, 4:] == choice[0, 4:]).all()


def test_sigmoid_router_bias_steers_choice_not_weights():
    rng = np.random.default_rng(1)
    cfg = _moe_cfg(router="sigmoid", n_experts_per_token=1, norm_topk_prob=False, routed_scaling_factor=2.0)
    moe = _random_moe(rng, cfg)
    moe.bias = np.zeros(cfg.n_experts, np.float32)
    moe.bias[3] = 10.0                                            # expert 3 always wins the choice ...
    h = rng.standard_normal((5, cfg.dim)).astype(np.float32)
    ids, weights = route(h, moe, cfg)
    assert (ids == 3).all()
    s = 1 / (1 + np.exp(-(h @ moe.router[3])))                    # ... but is weighed by its own sigmoid
    np.testing.assert_allclose(weights[:, 0], 2.0 * s, rtol=1e-6)


def test_sparse_dispatch_equals_every_expert_on_every_token():
    rng = np.random.default_rng(2)
    cfg = _moe_cfg(router="sigmoid", n_experts_per_token=3, n_expert_groups=4, n_groups_per_token=2,
                   routed_scaling_factor=2.5, n_shared_experts=1)
    moe = _random_moe(rng, cfg, shared=True)
    h = rng.standard_normal((25, cfg.dim)).astype(np.float32)
    ids, weights = route(h, moe, cfg)
    dense = np.zeros((cfg.n_experts, 25))                          # the weight of expert e for token t
    np.put_along_axis(dense.T, ids, weights, axis=-1)
    every = np.stack([e(h) for e in moe.experts])                  # [E, T, dim]: all experts, all tokens
    expected = (dense[:, :, None] * every).sum(0) + moe.shared(h)
    np.testing.assert_allclose(moe_block(h, moe, cfg), expected, atol=1e-5)


def test_unsupported_moe_configs_are_refused_in_one_line(tmp_path):
    from minillm.checkpoints.weights import read_config
    from minillm.errors import MiniLLMError
    d = deepseek_moe_config().to_dict() | {"architectures": ["DeepseekV3ForCausalLM"], "scoring_func": "softmax"}
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(MiniLLMError, match="scoring_func"):
        read_config(tmp_path)
    d |= {"scoring_func": "sigmoid", "n_group": 3}
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(MiniLLMError, match="n_group"):
        read_config(tmp_path)
