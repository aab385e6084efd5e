"""GPT-OSS (GptOssForCausalLM) matches HF transformers on random small models: attention sinks, windowed and
full layers in turn, YaRN, attention biases, and MoE layers with a biased router and clamped-SwiGLU experts;
the MXFP4 release format loads as shipped (the experts stay 4-bit) and matches HF on the same file."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import minillm
from hf_models import SMALL, hf_logits, save_random_model
from minillm.checkpoints.hf_layouts import pack_gpt_oss_experts
from minillm.checkpoints.weights import read_safetensors, write_safetensors
from minillm.engine.engine import Engine
from minillm.engine.generate import generate_ids
from minillm.engine.sampling import SamplingParams
from minillm.errors import MiniLLMError
from minillm.model.formats import Mxfp4Weight

TOL = 1e-4
TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 32, "rope_theta": 1000.0}


@pytest.fixture(scope="module", autouse=True)
def _one_blas_thread():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINILLM_THREADS", "1")
        yield


def gpt_oss_config(**extra):
    from transformers import GptOssConfig
    shape = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=64,
                 num_local_experts=4, num_experts_per_tok=2, sliding_window=4, swiglu_limit=3.0, rope_parameters=YARN)
    return GptOssConfig(**(SMALL | shape | extra))


CASES = {   # several shapes: GQA + YaRN, MHA with 8 experts and no scaling, MQA with every layer windowed
    "gqa-yarn": lambda: gpt_oss_config(),
    "mha-8-experts": lambda: gpt_oss_config(num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                                            num_local_experts=8, num_experts_per_tok=3, sliding_window=3,
                                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "mqa-all-windowed": lambda: gpt_oss_config(num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=2,
                                               layer_types=["sliding_attention"] * 2, swiglu_limit=7.0),
}


def save_gpt_oss(config, path, seed=0):
    """A random GPT-OSS whose sinks, clamps and RoPE matter: HF's init (std 0.02) leaves every score near 0
    and every gate far inside the clamp, where a model without them would pass too."""
    model = save_random_model(config, path, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(2.0 * torch.randn(p.shape, generator=g))
            elif "experts.gate_up_proj" in name and not name.endswith("bias"):
                p.copy_(0.4 * torch.randn(p.shape, generator=g))
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_gpt_oss(CASES[request.param](), path)
    return hf, minillm.load(str(path)), path


def _ids(n=20, seed=1):
    return np.random.default_rng(seed).integers(0, SMALL["vocab_size"], n).tolist()


def test_gpt_oss_matches_hf_logits_at_every_position(pair):
    hf, llm, _ = pair
    ids = _ids()
    np.testing.assert_allclose(llm.logits(ids), hf_logits(hf, ids), atol=TOL, rtol=0)


def test_gpt_oss_decodes_through_the_kv_cache_like_hf(pair):
    """Past the window, decode steps see the last W keys on windowed layers and every key on full ones."""
    hf, llm, _ = pair
    ids = _ids()
    cache = llm.model.new_cache(len(ids))
    llm.model.prefill(ids[:5], cache)
    stepped = np.stack([llm.model.decode(t, cache) for t in ids[5:]])
    np.testing.assert_allclose(stepped, hf_logits(hf, ids)[5:], atol=TOL, rtol=0)


@pytest.mark.parametrize("pair", ["gqa-yarn"], indirect=True)     # one shape: HF's generate is the slow part
def test_gpt_oss_greedy_32_tokens_equal_hf_generate(pair):
    hf, llm, _ = pair
    prompt = _ids(6, seed=3)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    expected = out[0, len(prompt):].tolist()
    assert generate_ids(llm.model, prompt, 32, SamplingParams()).token_ids == expected


def test_the_batched_engine_runs_sinks_and_layer_windows(pair):
    _, llm, _ = pair
    prompts = [_ids(n, seed=n) for n in (3, 11, 7)]
    alone = [generate_ids(llm.model, p, 10, SamplingParams()).token_ids for p in prompts]
    assert [r.token_ids for r in Engine(llm, max_batch_tokens=8).generate(prompts, max_tokens=10)] == alone


def test_sinks_clamps_and_windows_each_matter(pair):
    """Each GPT-OSS piece changes the logits: the parity above would catch its absence."""
    hf, _, path = pair
    ids = _ids(16)
    expected = hf_logits(hf, ids)
    for change in ("sinks", "clamp", "windows"):
        llm = minillm.load(str(path))
        for layer in llm.model.layers:
            if change == "sinks":
                layer.sinks = None
            if change == "clamp":
                for e in layer.moe.experts:
                    e.swiglu_limit = 1e9
        if change == "windows":
            llm.model.config = llm.model.config.replace(layer_windows=None, sliding_window=None)
        assert np.abs(llm.logits(ids) - expected).max() > 10 * TOL, change


def test_mxfp4_release_loads_as_shipped_and_matches_hf(tmp_path):
    """A checkpoint in GPT-OSS's release layout (quant_method mxfp4: expert blocks and E8M0 scales, the rest
    float): HF dequantizes it on load, minillm keeps every expert 4-bit and computes with the codes."""
    from transformers import AutoModelForCausalLM
    save_gpt_oss(gpt_oss_config(), tmp_path / "float")
    (tmp_path / "mxfp4").mkdir()
    packed = pack_gpt_oss_experts(read_safetensors(tmp_path / "float" / "model.safetensors"))
    write_safetensors(tmp_path / "mxfp4" / "model.safetensors", packed)
    tmp_path = tmp_path / "mxfp4"
    (tmp_path / "config.json").write_text((tmp_path.parent / "float" / "config.json").read_text())
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    llm = minillm.load(str(tmp_path))
    expert = llm.model.layers[0].moe.experts[1]
    assert all(isinstance(w, Mxfp4Weight) and w.qweight.dtype == np.uint8 for w in expert.matrices())
    assert not expert.w_gate.qweight.flags.owndata                # a view of the file's bytes, not a copy
    ids = _ids()
    np.testing.assert_allclose(llm.logits(ids), hf_logits(hf, ids), atol=TOL, rtol=0)


def test_an_unimplemented_gpt_oss_field_is_refused_in_one_line(tmp_path):
    save_random_model(gpt_oss_config(num_hidden_layers=2), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["experts_per_token"] = 3                              # disagrees with num_experts_per_tok=2
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(MiniLLMError, match="num_experts_per_tok=2 disagrees with experts_per_token=3") as e:
        minillm.load(str(tmp_path))
    assert "\n" not in str(e.value)


# ---- the o200k_harmony tokenizer, and the harmony channels as reasoning ------------------------------

def o200k_harmony_spec(monkeypatch) -> dict:
    """tiktoken's own o200k_harmony definition (its split regex and special tokens) without the 3.6 MB rank
    file, which tiktoken downloads and this machine cannot: the loader is handed an empty table."""
    import tiktoken_ext.openai_public as openai_public
    monkeypatch.setattr(openai_public, "load_tiktoken_bpe", lambda *args, **kwargs: {})
    return openai_public.o200k_harmony()


@pytest.fixture(scope="module")
def harmony_tokenizer(tmp_path_factory):
    """A byte-level BPE trained here with o200k_harmony's split regex and harmony's special tokens (ids moved
    down to follow the small vocabulary), saved as GPT-OSS's tokenizer.json is laid out."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from tokenizer_corpus import _trained
    with pytest.MonkeyPatch.context() as mp:
        spec = o200k_harmony_spec(mp)
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(spec["pat_str"]), "isolated"),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    t.decoder = decoders.ByteLevel()
    vocab, _ = _trained(t, 700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    first = min(spec["special_tokens"].values())
    specials = {name: len(vocab) + i - first for name, i in spec["special_tokens"].items()
                if i - first < 64}                                   # the harmony tokens, not the 1000 reserved
    t.add_special_tokens([AddedToken(name, special=True, normalized=False)
                          for name, _ in sorted(specials.items(), key=lambda item: item[1])])
    path = tmp_path_factory.mktemp("o200k_harmony")
    save_random_model(gpt_oss_config(num_hidden_layers=1, vocab_size=len(vocab) + 128), path)   # a GPT-OSS dir
    t.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|return|>"}))
    (path / "chat_template.jinja").write_text((TEMPLATES / "gpt_oss.jinja").read_text())
    return path, spec, vocab, specials


def test_o200k_harmony_tokenizer_matches_hf_tokenizers_and_tiktoken(harmony_tokenizer):
    """A GPT-OSS checkpoint's tokenizer (o200k_harmony's layout) encodes as HF tokenizers and tiktoken do,
    tiktoken running o200k_harmony's own regex and special tokens over the same ranks."""
    import tiktoken
    from tokenizers import Tokenizer
    from tokenizer_corpus import generated_texts
    path, spec, vocab, specials = harmony_tokenizer
    byte_of = {c: b for b, c in zip(*_byte_level_alphabet())}
    ranks = {bytes(byte_of[c] for c in piece): i for piece, i in vocab.items()}
    enc = tiktoken.Encoding("o200k_harmony-small", pat_str=spec["pat_str"], mergeable_ranks=ranks,
                            special_tokens=specials)
    hf, ours = Tokenizer.from_file(str(path / "tokenizer.json")), minillm.load(str(path)).tokenizer
    texts = generated_texts(seed=5) + [
        "<|start|>user<|message|>What is 2+2?<|end|><|start|>assistant<|channel|>analysis<|message|>Add.<|end|>",
        "I'm DONE'S 1234567 ...  \n\n  x", "naïve café 数据 😀 THE'll"]
    for text in texts:
        ids = hf.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, allow_special=True) == ids == enc.encode(text, allowed_special="all"), text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=False) == enc.decode(ids), text


def _byte_level_alphabet():
    """GPT-2's byte-to-character table (ByteLevel's): bytes, and the printable characters they are spelled as."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    extra = [b for b in range(256) if b not in printable]
    return printable + extra, [chr(b) for b in printable] + [chr(256 + i) for i in range(len(extra))]


def test_harmony_channels_come_back_as_reasoning_and_content(harmony_tokenizer):
    """A GPT-OSS answer's analysis channel is its reasoning, the final channel its content, streamed a few
    characters at a time or whole: the splitter picked for a harmony tokenizer cuts both alike."""
    from minillm.engine.reasoning import HarmonySplitter, split_answer, splitter_for
    tokenizer = minillm.load(str(harmony_tokenizer[0])).tokenizer
    answer = ("<|channel|>analysis<|message|>User asks 2+2. Easy: 4.<|end|><|start|>assistant<|channel|>final"
              "<|message|>2 + 2 = 4.")
    assert split_answer(tokenizer, None, answer) == ("User asks 2+2. Easy: 4.", "2 + 2 = 4.")
    splitter = splitter_for(tokenizer)
    assert isinstance(splitter, HarmonySplitter)
    pieces = [splitter.push(answer[i:i + 3]) for i in range(0, len(answer), 3)] + [splitter.finish()]
    assert ("".join(r for r, _ in pieces), "".join(c for _, c in pieces)) == ("User asks 2+2. Easy: 4.", "2 + 2 = 4.")
    assert split_answer(tokenizer, None, "<|channel|>final<|message|>Just this.") == (None, "Just this.")


def test_the_planner_gives_each_gpt_oss_checkpoints_bytes_exactly(tmp_path):
    """Lesson 23's walk-through: a small GPT-OSS written in bf16, fp8 and MXFP4 experts holds exactly the
    tensor bytes the planner computes for its config (the arithmetic behind 240 -> 120 -> 65 GB)."""
    import runpy
    from minillm.checkpoints.hf_quantized import translate_config
    from minillm.model.config import ModelConfig
    from minillm.tools import planner
    lesson = runpy.run_path(str(Path(__file__).parents[1] / "lessons" / "23_number_formats.py"), run_name="lesson")
    config = json.loads((Path(planner.__file__).parent / "data" / "gpt-oss-120b.config.json").read_text())
    config |= {"hidden_size": 64, "intermediate_size": 32, "head_dim": 16, "num_attention_heads": 4,
               "num_key_value_heads": 1, "num_local_experts": 4, "num_hidden_layers": 2,
               "layer_types": ["sliding_attention", "full_attention"], "vocab_size": 96}
    small = ModelConfig.from_hf(translate_config(config))
    files = lesson["write_gpt_oss_checkpoints"](small, config, tmp_path)
    assert {fmt: lesson["tensor_bytes"](path) for fmt, path in files.items()} == \
        {fmt: planner.weight_bytes(small, fmt) for fmt in files}
    assert minillm.load(str(tmp_path / "mxfp4")).logits([1, 2, 3]).shape == (3, 96)


def test_convert_keeps_the_mxfp4_experts_as_shipped(tmp_path):
    """`minillm convert` of the MXFP4 release writes the experts' codes and scales unchanged (minillm's names):
    the copy loads with MXFP4 experts and the very same logits."""
    from minillm.checkpoints.convert import convert
    save_gpt_oss(gpt_oss_config(num_hidden_layers=2), tmp_path / "float")
    (tmp_path / "src").mkdir()
    write_safetensors(tmp_path / "src" / "model.safetensors",
                      pack_gpt_oss_experts(read_safetensors(tmp_path / "float" / "model.safetensors")))
    config = json.loads((tmp_path / "float" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    convert(tmp_path / "src", tmp_path / "dst", progress=False)
    shipped, copied = minillm.load(str(tmp_path / "src")), minillm.load(str(tmp_path / "dst"))
    assert isinstance(copied.model.layers[1].moe.experts[3].w_down, Mxfp4Weight)
    ids = _ids(12)
    np.testing.assert_array_equal(copied.logits(ids), shipped.logits(ids))


GPT_OSS_CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Bonjour !", "thinking": "They greet me; answer in French."},
     {"role": "user", "content": "Again"}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": "", "thinking": "Call the tool.", "tool_calls": [{"type": "function", "function": {
         "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
     {"role": "tool", "content": "{\"temp\": 21}"}],
]
GPT_OSS_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "A city"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
        "days": {"type": "array", "items": {"type": "integer"}}}}}}]


@pytest.mark.parametrize("tools", [None, GPT_OSS_TOOLS])
@pytest.mark.parametrize("n", range(len(GPT_OSS_CONVERSATIONS)))
def test_gpt_oss_chat_template_renders_like_hf(harmony_tokenizer, n, tools):
    """GPT-OSS's harmony template (system and developer messages, tools as a TypeScript namespace, earlier
    reasoning dropped, tool calls and results): minillm renders it and encodes it as HF's apply_chat_template."""
    from transformers import AutoTokenizer
    path = harmony_tokenizer[0]
    hf, ours = AutoTokenizer.from_pretrained(path), minillm.load(str(path)).tokenizer
    messages = GPT_OSS_CONVERSATIONS[n]
    expected = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert ours.render_chat(messages, tools=tools) == expected
    assert ours.encode_chat(messages, tools=tools) == hf(expected, add_special_tokens=False).input_ids


# ---- a GGUF file written by llama.cpp's own converter ("gpt-oss") ---------------------------------
# The converter's GPT-OSS class takes its vocabulary from an HF tokenizer it must recognize by a hash of its
# output (o200k_harmony; our small one it does not know). This runs it with the generic step that reads a
# Llama-style tokenizer.json: the tensors and metadata under test are the converter's own.
_CONVERT_GPT_OSS = """
import runpy, sys
root = sys.argv.pop(1)
sys.path[:0] = [root + "/gguf-py", root]
from conversion.base import TextModel
from conversion.gpt_oss import GptOssModel
GptOssModel.set_vocab = TextModel._set_vocab_llama_hf
sys.argv[0] = root + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_gpt_oss_gguf_from_llama_cpps_converter_keeps_mxfp4_and_matches_hf(llama_cpp_convert, tmp_path):
    """llama.cpp converts the MXFP4 release into its "gpt-oss" GGUF (experts in ggml's MXFP4 blocks, sinks, biases,
    YaRN). minillm keeps each expert as the release's own codes and scale bytes (bit-exact) and gives HF's logits.
    The file has no clamp or window pattern: llama.cpp's (7.0; even layers windowed) are HF's defaults, and its
    YaRN rounds the correction range (truncate=True)."""
    import shutil
    import subprocess
    import sys
    from transformers import AutoModelForCausalLM
    import llama_cpp_converter
    llama_cpp_converter.save_tiny_llama(tmp_path / "tok", layers=1)         # its 289-token tokenizer
    config = gpt_oss_config(vocab_size=289, hidden_size=256, intermediate_size=256, swiglu_limit=7.0,
                            rope_parameters=YARN | {"truncate": True})
    save_gpt_oss(config, tmp_path / "float")
    release = tmp_path / "mxfp4"
    release.mkdir()
    packed = pack_gpt_oss_experts(read_safetensors(tmp_path / "float" / "model.safetensors"))
    write_safetensors(release / "model.safetensors", packed)
    hf_config = json.loads((tmp_path / "float" / "config.json").read_text())
    hf_config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (release / "config.json").write_text(json.dumps(hf_config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tmp_path / "tok" / name, release / name)
    done = subprocess.run([sys.executable, "-c", _CONVERT_GPT_OSS, str(llama_cpp_converter.converter_dir()),
                           str(release), "--outfile", str(tmp_path / "oss.gguf"), "--outtype", "f32"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]

    llm = minillm.load(str(tmp_path / "oss.gguf"))
    c = llm.config
    assert (c.family, c.n_experts, c.n_experts_per_token, c.layer_windows, c.swiglu_limit) == \
        ("gpt_oss", 4, 2, (4, None, 4, None), 7.0)
    expert = llm.model.layers[0].moe.experts[1]
    assert all(isinstance(w, Mxfp4Weight) for w in expert.matrices())
    gate_up = packed["model.layers.0.mlp.experts.gate_up_proj_blocks"][1][0::2]   # expert 1's gate rows [out, in/32, 16]
    np.testing.assert_array_equal(expert.w_gate.qweight, gate_up.reshape(len(gate_up), -1))
    np.testing.assert_array_equal(expert.w_gate.scales, packed["model.layers.0.mlp.experts.gate_up_proj_scales"][1][0::2])
    hf = AutoModelForCausalLM.from_pretrained(release, dtype=torch.float32).eval()   # dequantizes the MXFP4 release
    ids = np.random.default_rng(1).integers(0, 289, 20).tolist()
    np.testing.assert_allclose(llm.logits(ids), hf_logits(hf, ids), atol=TOL, rtol=0)
