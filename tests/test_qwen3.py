"""Qwen3 (QK-norm, explicit head_dim, tied or untied) and Qwen3-MoE (softmax top-k, normalized or not, no
shared expert) against HF transformers on random small models: logits at every position, decode through the
KV cache, 32 greedy tokens, the batching engine; Qwen's byte-level BPE and its chat template (thinking and
tools) against HF's tokenizer; the fields minillm does not implement refused in one line."""
import numpy as np
import pytest
from click.testing import CliRunner

import minillm
from hf_models import hf_logits, qwen3_config, qwen3_moe_config, save_random_model
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
    "qwen3-gqa-untied": lambda: qwen3_config(n_heads=4, n_kv_heads=2, head_dim=32),   # 4 x 32 = 128 != 64 wide
    "qwen3-mqa-tied": lambda: qwen3_config(n_heads=8, n_kv_heads=1, head_dim=16, tied=True),
    "qwen3-attention-bias": lambda: qwen3_config(n_heads=4, n_kv_heads=4, head_dim=16, attention_bias=True),
    "qwen3-moe-normalized": lambda: qwen3_moe_config(norm_topk_prob=True),
    "qwen3-moe-raw-topk": lambda: qwen3_moe_config(norm_topk_prob=False, num_experts=6, num_experts_per_tok=3),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_random_model(CASES[request.param](), path)
    return hf, minillm.load(str(path)), path


def _ids(n=20, vocab=320, seed=1):
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def test_qwen3_matches_hf_logits_at_every_position(pair):
    hf, llm, _ = pair
    ids = _ids()
    np.testing.assert_allclose(llm.logits(ids), hf_logits(hf, ids), atol=TOL, rtol=0)


def test_qwen3_decodes_through_the_kv_cache_like_hf(pair):
    hf, llm, _ = pair
    ids = _ids()
    expected = hf_logits(hf, ids)
    cache = llm.model.new_cache(len(ids))
    llm.model.prefill(ids[:6], cache)
    stepped = np.stack([llm.model.decode(t, cache) for t in ids[6:]])
    np.testing.assert_allclose(stepped, expected[6:], atol=TOL, rtol=0)


def test_qwen3_greedy_equals_hf_over_32_tokens(pair):
    """Each of minillm's 32 greedy tokens is HF's argmax after the same prefix: HF's greedy decode, checked
    in one HF forward pass instead of 32 (generate() would take seconds per case on two cores)."""
    hf, llm, _ = pair
    prompt = _ids(8, seed=3)
    ours = generate_ids(llm.model, prompt, 32, SamplingParams(0.0), stop_ids=set()).token_ids
    assert ours == hf_logits(hf, prompt + ours[:-1]).argmax(-1)[len(prompt) - 1:].tolist()


def test_qwen3_config_round_trips(pair):
    _, llm, path = pair
    c = llm.config
    assert c.qk_norm and c.family in ("qwen3", "qwen3_moe")
    assert ModelConfig.from_hf(c.to_hf()) == c


def test_the_qk_norm_matters(pair):
    """With QK-norm's gains set to one the logits move: the parity above is not a Llama's."""
    hf, _, path = pair
    llm, ids = minillm.load(str(path)), _ids(8)
    for layer in llm.model.layers:
        layer.q_norm, layer.k_norm = np.ones_like(layer.q_norm), np.ones_like(layer.k_norm)
    assert np.abs(llm.logits(ids) - hf_logits(hf, ids)).max() > 10 * TOL


def test_batched_engine_equals_generate_on_qwen3(tmp_path):
    """The engine runs the Transformer's own qkv() (QK-norm inside) and ffn() (the MoE router inside)."""
    save_random_model(qwen3_moe_config(eos_token_id=None), tmp_path)
    llm = minillm.load(str(tmp_path))
    prompts = [_ids(n, seed=n) for n in (3, 17, 9)]
    alone = [generate_ids(llm.model, p, 12, SamplingParams()).token_ids for p in prompts]
    assert [r.token_ids for r in Engine(llm, max_batch_tokens=8).generate(prompts, max_tokens=12)] == alone


def test_unimplemented_qwen3_moe_layouts_are_refused_in_one_line(tmp_path):
    from minillm.cli import cli
    save_random_model(qwen3_moe_config(decoder_sparse_step=2), tmp_path)
    with pytest.raises(MiniLLMError, match="decoder_sparse_step=2"):
        minillm.load(str(tmp_path))
    result = CliRunner().invoke(cli, ["generate", "--model", str(tmp_path), "--max-tokens", "2", "hi"])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code not in (0, None) and len(lines) == 1 and "decoder_sparse_step" in lines[0], result.stderr


# ---- the tokenizer and the chat template -----------------------------------------------------------

def test_qwen_byte_level_bpe_matches_hf_tokenizers(qwen_tokenizer_dir):
    from tokenizers import Tokenizer
    from tokenizer_corpus import generated_texts
    from minillm.checkpoints.tokenizer_files import load_tokenizer
    hf, ours = Tokenizer.from_file(str(qwen_tokenizer_dir / "tokenizer.json")), load_tokenizer(qwen_tokenizer_dir)
    texts = generated_texts(seed=7) + ["<think>\nplan</think>\n\n42", "a<tool_call>{}</tool_call>"]
    for text in texts:
        ids = hf.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, allow_special=True) == ids, text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=False), text   # NFC-composed, as HF's


CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "<think>\nsay hello\n</think>\n\nHello!"}, {"role": "user", "content": "Again"}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
         "name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "{\"temp\": 21}"}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("n", range(len(CONVERSATIONS)))
def test_qwen3_chat_template_renders_like_hf(qwen_tokenizer_dir, n, tools, thinking):
    from transformers import AutoTokenizer
    from minillm.checkpoints.tokenizer_files import load_tokenizer
    hf, ours = AutoTokenizer.from_pretrained(qwen_tokenizer_dir), load_tokenizer(qwen_tokenizer_dir)
    messages = CONVERSATIONS[n]
    expected = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                      enable_thinking=thinking)
    assert ours.render_chat(messages, tools=tools, enable_thinking=thinking) == expected
    assert ours.encode_chat(messages, tools=tools, enable_thinking=thinking) == \
        hf(expected, add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def qwen_tokenizer_dir(tmp_path_factory):
    from tokenizer_corpus import qwen_tokenizer
    path = tmp_path_factory.mktemp("qwen-tokenizer")
    qwen_tokenizer(path)
    return path


def test_the_qwen3_preset_is_the_hub_config():
    """Qwen/Qwen3-0.6B's config.json (as published) reads as the preset: `minillm presets` shows the real shape."""
    from minillm.model.config import PRESETS
    hub = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
           "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
           "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
           "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
           "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
           "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
           "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
    assert ModelConfig.from_hf(hub) == PRESETS["qwen3-0.6b"].config


# ---- a GGUF file written by llama.cpp's own converter ("qwen3") -----------------------------------

@pytest.fixture(scope="module")
def qwen3_q8_0_gguf(llama_cpp_convert, tmp_path_factory):
    """A random Qwen3 (widths multiples of 256: llama.cpp's block sizes) and the Q8_0 GGUF
    convert_hf_to_gguf.py writes of it (one conversion: ~15 s)."""
    from tokenizer_corpus import sentencepiece_model
    path = tmp_path_factory.mktemp("qwen3-gguf")
    hf = save_random_model(qwen3_config(vocab_size=640, hidden_size=256, intermediate_size=512), path / "hf")
    sentencepiece_model(path / "hf")
    return hf, llama_cpp_convert(path / "hf", path / "qwen3-q8_0.gguf", "q8_0")


def test_qwen3_gguf_from_llama_cpps_converter_keeps_hfs_row_order(qwen3_q8_0_gguf):
    """llama.cpp does not permute Qwen3's q/k rows (it rotates HF's halves, unlike its "llama"): read as
    "qwen3", the Q8_0 blocks kept quantized give the dequantized file's logits, and those are HF's up to
    Q8_0's rounding (a row order gone wrong moves them by whole units). The f32 path is held to 1e-4 by
    the Gemma 3 GGUF test."""
    from minillm.checkpoints.gguf_import import load_gguf
    from minillm.checkpoints.gguf_quantized import load_gguf_for_cpu
    from minillm.model.transformer import Transformer
    hf, gguf = qwen3_q8_0_gguf
    ids = _ids(vocab=640)
    models = [Transformer(*loaded) for loaded in (load_gguf_for_cpu(gguf, how="kept"), load_gguf(gguf))]
    assert (models[0].config.family, models[0].config.qk_norm, models[0].config.head_dim) == ("qwen3", True, 32)
    kept, floats = (m.prefill(ids, m.new_cache(len(ids)), all_logits=True) for m in models)
    np.testing.assert_allclose(kept, floats, atol=TOL, rtol=0)
    np.testing.assert_allclose(kept, hf_logits(hf, ids), atol=0.05, rtol=0)
    assert np.abs(minillm.load(str(gguf)).logits(ids) - kept).max() <= TOL      # what `minillm.load` takes


# The converter's Qwen3-MoE class takes its vocabulary from an HF tokenizer it must recognize by a hash of
# its output (our trained one it does not know); its dense Qwen class reads tokenizer.model first. This runs
# the converter with the dense class's vocabulary step: the tensors and metadata under test are its own.
_CONVERT_QWEN3_MOE = """
import runpy, sys
root = sys.argv.pop(1)
sys.path[:0] = [root + "/gguf-py", root]
from conversion.qwen import Qwen2Model, Qwen3MoeModel
Qwen3MoeModel.set_vocab = Qwen2Model.set_vocab
sys.argv[0] = root + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_qwen3_moe_gguf_from_llama_cpps_converter_matches_hf(llama_cpp_convert, tmp_path):
    """llama.cpp writes Qwen3-MoE as "qwen3moe": stacked experts, the router, expert_feed_forward_length; it
    renormalizes the top-k weights always (the file does not say norm_topk_prob), and so does minillm."""
    import subprocess
    import sys
    import llama_cpp_converter
    from tokenizer_corpus import sentencepiece_model
    hf = save_random_model(qwen3_moe_config(vocab_size=640, hidden_size=256, moe_intermediate_size=256), tmp_path / "hf")
    sentencepiece_model(tmp_path / "hf")
    done = subprocess.run([sys.executable, "-c", _CONVERT_QWEN3_MOE, str(llama_cpp_converter.converter_dir()),
                           str(tmp_path / "hf"), "--outfile", str(tmp_path / "moe.gguf"), "--outtype", "f32"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    llm, ids = minillm.load(str(tmp_path / "moe.gguf")), _ids(vocab=640)
    c = llm.config
    assert (c.family, c.n_experts, c.n_experts_per_token, c.moe_ffn_dim, c.norm_topk_prob) == ("qwen3_moe", 4, 2, 256, True)
    np.testing.assert_allclose(llm.logits(ids), hf_logits(hf, ids), atol=TOL, rtol=0)
