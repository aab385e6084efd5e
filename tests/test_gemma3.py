"""Gemma 3 text against HF transformers on random small models: sandwich norms with (1 + w) gains, GeGLU
(tanh GELU), embeddings scaled by sqrt(dim), windowed and global layers interleaved with their own RoPE
bases, QK-norm, query_pre_attn_scalar, final logit softcapping; the hub's older config keys; Gemma's
SentencePiece-style BPE and chat template against HF's tokenizer; what is not implemented refused in one line."""
import json

import numpy as np
import pytest
import torch

import minillm
from hf_models import SMALL, gemma3_config, hf_logits, save_random_model
from minillm.engine.engine import Engine
from minillm.engine.generate import generate_ids
from minillm.engine.sampling import SamplingParams
from minillm.errors import MiniLLMError
from minillm.model.config import ModelConfig

TOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def _one_blas_thread():
    """Every load would time BLAS thread counts first (~0.3 s); these tests load tiny models many times."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINILLM_THREADS", "1")
        yield


CASES = {
    # windowed / global / windowed, window 5 over 20 positions, scores over sqrt(24) (not sqrt(32))
    "gemma3-interleaved-mqa": lambda: gemma3_config(),
    # every layer windowed (a rolling cache), untied head, logits softcapped at 3
    "gemma3-all-windowed-softcap": lambda: gemma3_config(
        n_heads=2, n_kv_heads=2, head_dim=48, sliding_window=4, tie_word_embeddings=False,
        final_logit_softcapping=3.0, layer_types=["sliding_attention"] * 3),
    # global first, then two windowed layers; linear RoPE scaling on the global one
    "gemma3-gqa-scaled-rope": lambda: gemma3_config(
        n_heads=4, n_kv_heads=2, head_dim=16, query_pre_attn_scalar=16,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_random_model(CASES[request.param](), path)
    return hf, minillm.load(str(path)), path


def _ids(n=20, seed=1):
    return np.random.default_rng(seed).integers(0, SMALL["vocab_size"], n).tolist()


def test_gemma3_matches_hf_logits_at_every_position(pair):
    hf, llm, _ = pair
    ids = _ids()
    np.testing.assert_allclose(llm.logits(ids), hf_logits(hf, ids), atol=TOL, rtol=0)


def test_gemma3_decodes_through_the_kv_cache_like_hf(pair):
    """Decode past the window: a rolling cache when every layer is windowed, masks per layer otherwise."""
    hf, llm, _ = pair
    ids = _ids()
    expected = hf_logits(hf, ids)
    cache = llm.model.new_cache(64)
    llm.model.prefill(ids[:3], cache)
    stepped = np.stack([llm.model.decode(t, cache) for t in ids[3:]])
    np.testing.assert_allclose(stepped, expected[3:], atol=TOL, rtol=0)


def test_gemma3_greedy_equals_hf_over_32_tokens(pair):
    """Each of minillm's 32 greedy tokens is HF's argmax after the same prefix: HF's greedy decode, checked
    in one HF forward pass instead of 32 (generate() would take seconds per case on two cores)."""
    hf, llm, _ = pair
    prompt = _ids(8, seed=3)
    ours = generate_ids(llm.model, prompt, 32, SamplingParams(0.0), stop_ids=set()).token_ids
    assert ours == hf_logits(hf, prompt + ours[:-1]).argmax(-1)[len(prompt) - 1:].tolist()


def test_gemma3_config_round_trips(pair):
    _, llm, _ = pair
    c = llm.config
    assert (c.family, c.norm_plus_one, c.sandwich_norms, c.activation) == ("gemma3_text", True, True, "gelu_tanh")
    assert ModelConfig.from_hf(c.to_hf()) == c


def test_batched_engine_equals_generate_on_gemma3(tmp_path):
    """The paged engine masks each layer with its own window and adds Gemma's output norms."""
    save_random_model(gemma3_config(eos_token_id=None), tmp_path)
    llm = minillm.load(str(tmp_path))
    prompts = [_ids(n, seed=n) for n in (3, 17, 9)]
    alone = [generate_ids(llm.model, p, 12, SamplingParams()).token_ids for p in prompts]
    assert [r.token_ids for r in Engine(llm, max_batch_tokens=8).generate(prompts, max_tokens=12)] == alone


def test_the_hubs_older_gemma3_config_keys_read_as_hf_reads_them(tmp_path):
    """google/gemma-3-*-it ship rope_theta, rope_local_base_freq, rope_scaling and sliding_window_pattern
    (no layer_types): HF and minillm must build the same model from them."""
    from transformers import AutoModelForCausalLM
    save_random_model(gemma3_config(layer_types=None), tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    for key in ("layer_types", "rope_parameters", "_sliding_window_pattern"):
        d.pop(key, None)
    d |= {"rope_theta": 50000.0, "rope_local_base_freq": 500.0, "sliding_window_pattern": 2,
          "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    (tmp_path / "config.json").write_text(json.dumps(d))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    llm = minillm.load(str(tmp_path))
    assert llm.config.layer_windows == (5, None, 5) and llm.config.rope_local_theta == 500.0
    ids = _ids()
    np.testing.assert_allclose(llm.logits(ids), hf_logits(hf, ids), atol=TOL, rtol=0)


def test_bf16_embeddings_are_scaled_in_bf16_as_hf_does(tmp_path):
    """sqrt(64) = 8 is exact in bf16; sqrt(72) is not: HF rounds the factor and the product to bf16."""
    hf = save_random_model(gemma3_config(hidden_size=72, intermediate_size=96), tmp_path).to(torch.bfloat16)
    llm = minillm.load(str(tmp_path), dtype="bfloat16")
    ids = _ids(8)
    with torch.no_grad():
        expected = hf.model.embed_tokens(torch.tensor(ids)).float().numpy()
    np.testing.assert_array_equal(llm.model.embed_tokens(np.asarray(ids)), expected)


@pytest.mark.parametrize("field, value", [("attn_logit_softcapping", 50.0), ("hidden_activation", "gelu"),
                                          ("use_bidirectional_attention", True)])
def test_unimplemented_gemma_fields_are_refused_in_one_line(tmp_path, field, value):
    save_random_model(gemma3_config(), tmp_path)
    d = json.loads((tmp_path / "config.json").read_text()) | {field: value}
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(MiniLLMError, match=field) as info:
        minillm.load(str(tmp_path))
    assert "\n" not in str(info.value)


def test_flashnorm_on_gemma3_is_refused_in_one_line(tmp_path):
    save_random_model(gemma3_config(), tmp_path)
    with pytest.raises(MiniLLMError, match="flashnorm is not implemented for QK-norm or sandwich norms") as info:
        minillm.load(str(tmp_path), flashnorm=True)
    assert "\n" not in str(info.value)


# ---- the tokenizer and the chat template -----------------------------------------------------------

@pytest.fixture(scope="module")
def gemma_tokenizer_dir(tmp_path_factory):
    from tokenizer_corpus import gemma_tokenizer
    path = tmp_path_factory.mktemp("gemma-tokenizer")
    gemma_tokenizer(path)
    return path


def test_gemma_sentencepiece_bpe_matches_hf_tokenizers(gemma_tokenizer_dir):
    """Spaces as ▁ with no dummy prefix, and characters outside the vocab as <0xNN> bytes."""
    from tokenizers import Tokenizer
    from tokenizer_corpus import generated_texts
    from minillm.checkpoints.tokenizer_files import load_tokenizer
    hf, ours = Tokenizer.from_file(str(gemma_tokenizer_dir / "tokenizer.json")), load_tokenizer(gemma_tokenizer_dir)
    byte_fallback = 0
    for text in generated_texts(seed=9) + [" leading space", "<start_of_turn>user\nhi<end_of_turn>"]:
        ids = hf.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, allow_special=True) == ids, text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=False), text
        byte_fallback += any(hf.id_to_token(i).startswith("<0x") for i in ids)
    assert byte_fallback > 0                      # the corpus reaches the byte fallback


CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again"}],
]
TOOLS = [{"type": "function", "function": {"name": "now", "description": "The time", "parameters": {}}}]


@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("n", range(len(CONVERSATIONS)))
def test_gemma3_chat_template_renders_like_hf(gemma_tokenizer_dir, n, tools):
    from transformers import AutoTokenizer
    from minillm.checkpoints.tokenizer_files import load_tokenizer
    hf, ours = AutoTokenizer.from_pretrained(gemma_tokenizer_dir), load_tokenizer(gemma_tokenizer_dir)
    expected = hf.apply_chat_template(CONVERSATIONS[n], tools=tools, tokenize=False, add_generation_prompt=True)
    assert ours.render_chat(CONVERSATIONS[n], tools=tools) == expected
    assert ours.encode_chat(CONVERSATIONS[n], tools=tools) == hf(expected, add_special_tokens=False).input_ids


def test_the_gemma3_preset_is_the_hub_config():
    """google/gemma-3-1b-it's config.json (as published) reads as the preset: five windowed layers of 512
    positions to one global, 26 layers."""
    from minillm.model.config import PRESETS
    hub = {"architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
           "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid",
           "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
           "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "initializer_range": 0.02,
           "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text",
           "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0,
           "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
           "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
           "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 262144}
    config = ModelConfig.from_hf(hub)
    assert config == PRESETS["gemma-3-1b"].config
    assert [i for i in range(26) if config.window(i) is None] == [5, 11, 17, 23]


# ---- a GGUF file written by llama.cpp's own converter ("gemma3") ----------------------------------

@pytest.fixture(scope="module")
def gemma3_gguf(llama_cpp_convert, tmp_path_factory):
    """A random Gemma 3 of 7 layers (llama.cpp fixes the pattern at 5 windowed : 1 global, the windowed
    base at 10000 and the score scale at 1/sqrt(head_dim), so the HF config does too) and the f32 GGUF
    convert_hf_to_gguf.py writes of it (one conversion: ~15 s)."""
    from tokenizer_corpus import sentencepiece_model
    path = tmp_path_factory.mktemp("gemma3-gguf")
    config = gemma3_config(vocab_size=640, hidden_size=256, intermediate_size=512, num_hidden_layers=7,
                           sliding_window=4, query_pre_attn_scalar=32, layer_types=None, rope_parameters=None)
    hf = save_random_model(config, path / "hf")
    sentencepiece_model(path / "hf")
    return hf, llama_cpp_convert(path / "hf", path / "gemma3-f32.gguf", "f32")


def test_gemma3_gguf_from_llama_cpps_converter_matches_hf(gemma3_gguf):
    """The converter stores Gemma's gains as 1 + w and names the sandwich norms its own way."""
    hf, gguf = gemma3_gguf
    llm, ids = minillm.load(str(gguf)), np.random.default_rng(1).integers(0, 640, 20).tolist()
    assert llm.config.layer_windows == (4, 4, 4, 4, 4, None, 4)
    np.testing.assert_allclose(llm.logits(ids), hf_logits(hf, ids), atol=TOL, rtol=0)


def test_gemma3_q8_0_gguf_from_llama_cpps_converter_is_q8_0s_rounding_only(gemma3_gguf, llama_cpp_convert):
    """The converter's Q8_0 Gemma 3 (layer matrices and the tied embedding in Q8_0, norms in f32, stored as
    1 + w) is 0.44 away from the source on this random model: that is Q8_0's rounding, because HF on the source
    weights put through gguf-py's own Q8_0 round trip gives the same logits as minillm on the file."""
    import copy
    import gguf as gguf_py
    from minillm.checkpoints.gguf_quantized import load_gguf_for_cpu
    from minillm.model.ggml_blocks import GGMLWeight
    from minillm.model.transformer import Transformer
    hf, f32 = gemma3_gguf
    path = llama_cpp_convert(f32.parent / "hf", f32.parent / "gemma3-q8_0.gguf", "q8_0")
    types = {t.name: t.tensor_type.name for t in gguf_py.GGUFReader(str(path)).tensors}
    assert {k for k, v in types.items() if v == "Q8_0"} == {k for k in types if not k.endswith("norm.weight")}

    q8 = gguf_py.GGMLQuantizationType.Q8_0
    rounded = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in rounded.named_parameters():        # the tied head is the embedding: rounded once
            if name.endswith("_proj.weight") or name.endswith("embed_tokens.weight"):
                w = p.numpy()
                p.copy_(torch.from_numpy(gguf_py.quants.dequantize(gguf_py.quants.quantize(w, q8), q8).reshape(w.shape)))
    config, tensors = load_gguf_for_cpu(path, how="kept")
    assert isinstance(tensors["model.layers.0.self_attn.q_proj.weight"], GGMLWeight)
    ids = np.random.default_rng(1).integers(0, 640, 20).tolist()
    model = Transformer(config, tensors)
    ours = model.prefill(ids, model.new_cache(len(ids) + 1), all_logits=True)
    np.testing.assert_allclose(ours, hf_logits(rounded, ids), atol=TOL, rtol=0)       # measured 1.4e-5
    np.testing.assert_allclose(minillm.load(str(path)).logits(ids), hf_logits(rounded, ids), atol=TOL, rtol=0)
    assert np.abs(ours - hf_logits(hf, ids)).max() > 0.1         # Q8_0 does move this model's logits
