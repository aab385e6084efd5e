"""Phi-3 / Phi-4-mini (Phi3ForCausalLM) match HF transformers on random small models: the fused qkv_proj and
gate_up_proj (split into views at load), RoPE on part of each head, LongRoPE's short and long factors."""
import json

import numpy as np
import pytest
import torch

import minillm
from hf_models import SMALL, hf_logits, save_random_model
from minillm.engine.engine import Engine
from minillm.engine.generate import generate_ids
from minillm.engine.sampling import SamplingParams
from minillm.errors import MiniLLMError

TOL = 1e-4
ORIGINAL = 16          # LongRoPE's pretraining context here: sequences past it turn at the long factors


@pytest.fixture(scope="module", autouse=True)
def _one_blas_thread():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINILLM_THREADS", "1")
        yield


def longrope(rotary_dim: int) -> dict:
    n = rotary_dim // 2
    return {"type": "longrope", "short_factor": np.linspace(1.0, 3.0, n).tolist(),
            "long_factor": np.linspace(1.0, 12.0, n).tolist()}


def phi3_config(n_heads=4, n_kv_heads=2, partial=0.75, scaling=True, **extra):
    from transformers import Phi3Config
    rotary = int(extra.get("hidden_size", SMALL["hidden_size"]) // n_heads * partial)
    return Phi3Config(**(SMALL | dict(num_attention_heads=n_heads, num_key_value_heads=n_kv_heads,
                                      partial_rotary_factor=partial, original_max_position_embeddings=ORIGINAL,
                                      rope_scaling=longrope(rotary) if scaling else None,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=None) | extra))


CASES = {   # Phi-4-mini's shape (GQA, partial RoPE, LongRoPE, tied), Phi-3-mini's (MHA, full RoPE, a window)
    "gqa-partial-longrope-tied": lambda: phi3_config(tie_word_embeddings=True),
    "mha-full-rope-window": lambda: phi3_config(n_heads=4, n_kv_heads=4, partial=1.0, scaling=False, sliding_window=5),
    "mqa-half-rope-longrope": lambda: phi3_config(n_heads=8, n_kv_heads=1, partial=0.5),
}


def save_phi3(config, path, seed=0):
    """A random Phi-3 whose RoPE matters: HF's init (std 0.02) leaves every attention score near 0."""
    model = save_random_model(config, path, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("qkv_proj.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_phi3(CASES[request.param](), path)
    return hf, minillm.load(str(path)), path


def _ids(n, seed=1):
    return np.random.default_rng(seed).integers(0, SMALL["vocab_size"], n).tolist()


@pytest.mark.parametrize("n", [ORIGINAL - 4, ORIGINAL + 14])     # LongRoPE's short factors, then its long ones
def test_phi3_matches_hf_logits_at_every_position(pair, n):
    hf, llm, _ = pair
    ids = _ids(n)
    np.testing.assert_allclose(llm.logits(ids), hf_logits(hf, ids), atol=TOL, rtol=0)


def test_phi3_decodes_through_the_kv_cache_like_hf(pair):
    hf, llm, _ = pair
    ids = _ids(ORIGINAL - 2)
    cache = llm.model.new_cache(len(ids))
    llm.model.prefill(ids[:4], cache)
    stepped = np.stack([llm.model.decode(t, cache) for t in ids[4:]])
    np.testing.assert_allclose(stepped, hf_logits(hf, ids)[4:], atol=TOL, rtol=0)


def test_phi3_greedy_32_tokens_equal_hf_generate(tmp_path):
    """Over 32 new tokens inside the pretraining context (HF's generate recomputes the whole cache when a
    sequence crosses it; minillm, as vLLM, keeps the keys already rotated: see Transformer.rope)."""
    hf = save_phi3(phi3_config(original_max_position_embeddings=64, max_position_embeddings=512), tmp_path)
    llm = minillm.load(str(tmp_path))
    prompt = _ids(6, seed=3)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, pad_token_id=0)
    assert generate_ids(llm.model, prompt, 32, SamplingParams()).token_ids == out[0, len(prompt):].tolist()


def test_the_fused_matrices_load_as_views_of_the_file(pair):
    """qkv_proj and gate_up_proj are split into row blocks of the mapped file, not copied at load."""
    from minillm.checkpoints.weights import load_hf_dir
    _, _, path = pair
    _, tensors = load_hf_dir(path)
    q, k = tensors["model.layers.0.self_attn.q_proj.weight"], tensors["model.layers.0.self_attn.k_proj.weight"]
    assert isinstance(q.base, np.ndarray) and np.shares_memory(q, k.base)
    assert "model.layers.0.self_attn.qkv_proj.weight" not in tensors


def test_the_batched_engine_runs_phi3(pair):
    _, llm, _ = pair
    prompts = [_ids(n, seed=n) for n in (3, 13, 7)]
    alone = [generate_ids(llm.model, p, 8, SamplingParams()).token_ids for p in prompts]
    assert [r.token_ids for r in Engine(llm, max_batch_tokens=8).generate(prompts, max_tokens=8)] == alone


def test_partial_rotary_and_longrope_matter(tmp_path):
    """Rotating every dim, or keeping the short factors past the context, changes the logits."""
    hf = save_phi3(phi3_config(), tmp_path)
    ids = _ids(ORIGINAL + 10)
    expected = hf_logits(hf, ids)
    for change in ({"partial_rotary_factor": 1.0}, "short only"):
        llm = minillm.load(str(tmp_path))
        if change == "short only":
            llm.model.inv_freq_long = llm.model.inv_freq
        else:
            llm.model.config = llm.model.config.replace(**change, rope_scaling=None)
            llm.model.inv_freq = 1.0 / (10000.0 ** (np.arange(0, 16, 2, dtype=np.float32) / 16))
            llm.model.inv_freq_long = None
        assert np.abs(llm.logits(ids) - expected).max() > 10 * TOL, change


def test_a_longrope_factor_list_of_the_wrong_length_is_refused_in_one_line(tmp_path):
    save_random_model(phi3_config(num_hidden_layers=1), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    scaling = config.pop("rope_parameters", None) or config["rope_scaling"]
    scaling["long_factor"] = scaling["long_factor"][:-1]
    config["rope_scaling"] = scaling
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(MiniLLMError, match="rope_scaling.long_factor has 5 numbers; the 12 rotary dims need 6") as e:
        minillm.load(str(tmp_path))
    assert "\n" not in str(e.value)


# ---- the chat template ----------------------------------------------------------------------------

PHI_CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You call tools.", "tools": '[{"name": "get_weather", "parameters": '
                                                             '{"city": {"type": "str"}}}]'},
     {"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'},
     {"role": "user", "content": "Thanks"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
]


@pytest.fixture(scope="module")
def phi_tokenizer_dir(tmp_path_factory):
    """A small byte-level BPE with Phi-4-mini's chat tokens and its chat template, beside a Phi-3 model."""
    from pathlib import Path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from tokenizer_corpus import _trained
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    _trained(t, 400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
                                                          "<|tool|>", "<|/tool|>"]})
    tok.chat_template = (Path(__file__).parent / "data" / "chat_templates" / "phi4_mini.jinja").read_text()
    path = tmp_path_factory.mktemp("phi-tokenizer")
    save_random_model(phi3_config(num_hidden_layers=1, vocab_size=len(tok) + 8), path)
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize("n", range(len(PHI_CONVERSATIONS)))
def test_phi4_mini_chat_template_renders_like_hf(phi_tokenizer_dir, n):
    """Phi-4-mini's template, tools included (its tools ride on the system message): minillm's rendering and
    token ids are HF's apply_chat_template's, for the tokenizer of a loaded Phi-3 checkpoint."""
    from transformers import AutoTokenizer
    hf, ours = AutoTokenizer.from_pretrained(phi_tokenizer_dir), minillm.load(str(phi_tokenizer_dir)).tokenizer
    messages = PHI_CONVERSATIONS[n]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.render_chat(messages) == expected
    assert ours.encode_chat(messages) == hf(expected, add_special_tokens=False).input_ids


def test_convert_writes_phi3_that_reloads_quantized(tmp_path):
    """`minillm convert --quant int8` of a Phi-3: the split matrices are quantized and written, the config
    (partial RoPE, LongRoPE) round-trips, and the copy runs as the model quantized at load does."""
    from minillm.checkpoints.convert import convert
    from minillm.model.config import ModelConfig
    save_phi3(phi3_config(), tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "dst", progress=False, quant="int8")
    llm = minillm.load(str(tmp_path / "dst"))
    assert llm.config.replace(quantization=None) == minillm.load(str(tmp_path / "src")).config
    assert ModelConfig.from_hf(llm.config.to_hf()) == llm.config
    ids = _ids(ORIGINAL + 4)
    np.testing.assert_array_equal(llm.logits(ids), minillm.load(str(tmp_path / "src"), quant="int8").logits(ids))


# ---- GGUF files written by llama.cpp's own converter ("phi3") -------------------------------------

@pytest.fixture(scope="module")
def phi3_ggufs(llama_cpp_convert, tmp_path_factory):
    """A random Phi-3 (partial RoPE, LongRoPE), the f32 GGUF convert_hf_to_gguf.py writes of it, and that file
    with its layer matrices in Q8_0 (gguf-py's quantizer, as test_gguf_quantized does: one conversion, not two)."""
    from test_gguf_quantized import requantize
    from tokenizer_corpus import sentencepiece_model
    path = tmp_path_factory.mktemp("phi3-gguf")
    hf = save_phi3(phi3_config(vocab_size=640, hidden_size=128, intermediate_size=256, num_hidden_layers=2), path / "hf")
    sentencepiece_model(path / "hf")
    f32 = llama_cpp_convert(path / "hf", path / "phi3-f32.gguf", "f32")
    q8_0 = requantize(f32, path / "phi3-q8_0.gguf", {part: "Q8_0" for part in ("attn_qkv", "attn_output", "ffn_")})
    return hf, {"f32": f32, "q8_0": q8_0}


def test_phi3_gguf_from_llama_cpps_converter_matches_hf(phi3_ggufs):
    """llama.cpp's phi3 GGUF (fused attn_qkv and ffn_up, rope.dimension_count for the partial share, LongRoPE's
    factors as tensors): read by minillm, HF's logits past the pretraining context too."""
    hf, ggufs = phi3_ggufs
    llm = minillm.load(str(ggufs["f32"]))
    assert (llm.config.family, llm.config.partial_rotary_factor, llm.config.rope_scaling["rope_type"]) == \
        ("phi3", 0.75, "longrope")
    ids = _ids(ORIGINAL + 14)
    np.testing.assert_allclose(llm.logits(ids), hf_logits(hf, ids), atol=TOL, rtol=0)


def test_phi3_q8_0_gguf_kept_quantized_splits_the_fused_blocks(phi3_ggufs):
    """Kept quantized, the fused Q8_0 matrices split into q/k/v and gate/up row blocks of the file's bytes and
    give the dequantized file's logits."""
    from minillm.checkpoints.gguf_import import load_gguf
    from minillm.checkpoints.gguf_quantized import load_gguf_for_cpu
    from minillm.model.ggml_blocks import GGMLWeight
    from minillm.model.transformer import Transformer
    _, ggufs = phi3_ggufs
    kept, floats = (Transformer(*loaded) for loaded in (load_gguf_for_cpu(ggufs["q8_0"], how="kept"),
                                                        load_gguf(ggufs["q8_0"])))
    assert all(isinstance(w, GGMLWeight) for w in (kept.layers[0].wq, kept.layers[0].wv, kept.layers[1].w_up))
    ids = _ids(ORIGINAL + 4)
    kept_logits, float_logits = (m.prefill(ids, m.new_cache(len(ids)), all_logits=True) for m in (kept, floats))
    np.testing.assert_allclose(kept_logits, float_logits, atol=TOL, rtol=0)
