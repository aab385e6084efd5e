"""Never silently wrong: config fields minillm does not implement, corrupt or inconsistent safetensors,
config.json, GGUF and tokenizer files, NaN weights and NaN logits each end in one clear line (a
MiniLLMError from the Python API, `minillm: error: ...` and a non-zero exit from the CLI), never in a
traceback, a hang, or wrong text with exit code 0."""
import json
import shutil
import signal
import struct
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import minillm
from minillm.cli import cli
from minillm.errors import MiniLLMError
from minillm.model.config import ConfigError, ModelConfig
from test_weights import tiny_llama, write_llama_gguf

PROMPT = "hello world"


@pytest.fixture(scope="module", autouse=True)
def _one_blas_thread():
    """Every load would time BLAS thread counts first (~0.3 s); these tests load tiny models many times."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINILLM_THREADS", "1")
        yield


# ---- the good files every case starts from --------------------------------------------------------------
@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict[str, Path]:
    """A tiny untied Llama as a GGUF (F32 and Q4_1) and as a converted HF dir (config.json, model.safetensors,
    tokenizer.json, tokenizer_config.json with a chat template)."""
    from minillm.checkpoints.convert import convert
    root = tmp_path_factory.mktemp("good")
    model = tiny_llama()
    write_llama_gguf(root / "tiny.gguf", model)
    from gguf import GGMLQuantizationType as Q
    write_llama_gguf(root / "tiny-q4_1.gguf", model, qtype=Q.Q4_1)
    convert(root / "tiny.gguf", root / "dir", progress=False, dtype="float32")
    return {"dir": root / "dir", "gguf": root / "tiny.gguf", "q4_1": root / "tiny-q4_1.gguf", "model": model}


def _copy(good, tmp_path) -> Path:
    return Path(shutil.copytree(good["dir"], tmp_path / "model"))


# ---- safetensors surgery ---------------------------------------------------------------------------------
def _read_st(file: Path) -> tuple[dict, bytes]:
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write_st(file: Path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    file.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def _edit_header(edit):
    def corrupt(d: Path):
        header, data = _read_st(d / "model.safetensors")
        edit(header)
        _write_st(d / "model.safetensors", header, data)
    return corrupt


def _edit_bytes(edit):
    def corrupt(d: Path):
        f = d / "model.safetensors"
        f.write_bytes(edit(f.read_bytes()))
    return corrupt


def _shape(name, shape):
    return _edit_header(lambda h: h[name].update(shape=shape))


def _drop(name):
    return _edit_header(lambda h: h.pop(name))


def _add_like(name, like, shape):
    """A tensor `name` of `shape` pointing at the first bytes of tensor `like`."""
    def edit(h):
        begin = h[like]["data_offsets"][0]
        h[name] = {"dtype": "F32", "shape": shape, "data_offsets": [begin, begin + 4 * int(np.prod(shape))]}
    return _edit_header(edit)


def _nan_tensor(name):
    def corrupt(d: Path):
        header, data = _read_st(d / "model.safetensors")
        begin, end = header[name]["data_offsets"]
        data = data[:begin] + np.full((end - begin) // 4, np.nan, np.float32).tobytes() + data[end:]
        _write_st(d / "model.safetensors", header, data)
    return corrupt


def _index_with_missing_shard(d: Path):
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    header, _ = _read_st(d / "model-00001-of-00002.safetensors")
    weight_map = {n: "model-00001-of-00002.safetensors" for n in header if n != "__metadata__"}
    weight_map["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _a_tensor_in_two_shards(d: Path):
    """Both shards hold every tensor: the index picks one copy of each, minillm used to load whichever came last."""
    shutil.copyfile(d / "model.safetensors", d / "model-00002-of-00002.safetensors")
    _index_with_missing_shard(d)


K = "model.layers.1.self_attn.k_proj.weight"      # [32, 64]
SAFETENSORS_CASES = {
    "truncated": _edit_bytes(lambda b: b[:len(b) // 2]),
    "empty-file": _edit_bytes(lambda b: b""),
    "header-length-past-the-end": _edit_bytes(lambda b: struct.pack("<Q", 1 << 40) + b[8:]),
    "header-not-json": _edit_bytes(lambda b: b[:8] + b"\xff" * 16 + b[24:]),
    "header-a-list": lambda d: _write_st(d / "model.safetensors", [], b""),
    "shape-transposed-same-bytes": _shape(K, [64, 32]),
    "shape-wrong-rank": _shape(K, [2048]),
    "missing-tensor": _drop("model.layers.1.self_attn.v_proj.weight"),
    "untied-without-lm-head": _drop("lm_head.weight"),
    "undeclared-bias": _add_like("model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.q_proj.weight", [64]),
    "unknown-tensor": _add_like("model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.q_proj.weight", [16]),
    "integer-dtype": _edit_header(lambda h: h["model.norm.weight"].update(dtype="I32")),
    "unknown-dtype": _edit_header(lambda h: h["model.norm.weight"].update(dtype="F8_E9M9")),
    "offsets-past-the-end": _edit_header(lambda h: h["model.norm.weight"].update(data_offsets=[0, 1 << 30])),
    "offsets-size-mismatch": _edit_header(lambda h: h[K].update(data_offsets=[0, 64])),
    # the safetensors library refuses these; minillm used to load the shared bytes as both tensors
    "offsets-overlap": _edit_header(lambda h: h[K].update(data_offsets=h[K.replace(".1.", ".0.")]["data_offsets"])),
    "bytes-after-the-last-tensor": _edit_bytes(lambda b: b + bytes(64)),
    "nan-weights": _nan_tensor("model.layers.0.mlp.down_proj.weight"),
    "no-weights-file": lambda d: (d / "model.safetensors").unlink(),
    "index-names-a-missing-shard": _index_with_missing_shard,
    "a-tensor-in-two-shards": _a_tensor_in_two_shards,
}


# ---- config.json -------------------------------------------------------------------------------------------
def _config(edit):
    def corrupt(d: Path):
        c = json.loads((d / "config.json").read_text())
        edit(c)
        (d / "config.json").write_text(json.dumps(c))
    return corrupt


def _set(**fields):
    return _config(lambda c: c.update(fields))


def _unset(*keys):
    return _config(lambda c: [c.pop(k, None) for k in keys])


CONFIG_CASES = {   # case: (corruption, the field the message must name)
    "layers-negative": (_set(num_hidden_layers=-1), "num_hidden_layers"),
    "layers-a-string": (_set(num_hidden_layers="2"), "num_hidden_layers"),
    "layers-a-fraction": (_set(num_hidden_layers=2.5), "num_hidden_layers"),
    "layers-more-than-the-tensors": (_set(num_hidden_layers=3), "num_hidden_layers"),
    "layers-fewer-than-the-tensors": (_set(num_hidden_layers=1), "num_hidden_layers"),
    "layers-2-to-the-31": (_set(num_hidden_layers=2**31), "num_hidden_layers"),      # hung, memory growing
    "experts-2-to-the-31": (_set(architectures=["MixtralForCausalLM"], model_type="mixtral",
                                 num_local_experts=2**31), "num_local_experts"),
    "zero-heads": (_set(num_attention_heads=0), "num_attention_heads"),
    "kv-heads-do-not-divide": (_set(num_key_value_heads=3), "num_key_value_heads"),
    "head-dim-odd": (_set(head_dim=15), "head_dim"),
    "head-dim-not-the-tensors": (_set(head_dim=32), "head_dim"),
    "rms-norm-eps-negative": (_set(rms_norm_eps=-1), "rms_norm_eps"),
    "rope-parameters-a-string": (_set(rope_parameters="llama3"), "rope_parameters"),   # ran at theta 10000
    "torch-dtype-an-object": (_set(torch_dtype={"weights": "float16"}), "torch_dtype"),
    "rope-theta-negative": (_set(rope_theta=-5, rope_parameters={"rope_theta": -5, "rope_type": "default"}), "rope_theta"),
    "hidden-size-not-the-tensors": (_set(hidden_size=32), "hidden_size"),
    "vocab-size-not-the-tensors": (_set(vocab_size=300), "vocab_size"),
    "intermediate-size-missing": (_unset("intermediate_size"), "intermediate_size"),
    "context-zero": (_set(max_position_embeddings=0), "max_position_embeddings"),
    "hidden-act-gelu": (_set(hidden_act="gelu"), "hidden_act"),
    "rope-scaling-dynamic": (_set(rope_scaling={"rope_type": "dynamic", "factor": 2.0},
                                  rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}), "rope_type"),
    "rope-scaling-llama3-incomplete": (_set(rope_scaling={"rope_type": "llama3", "factor": 8.0},
                                            rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}),
                                       "rope_scaling.low_freq_factor"),
    "partial-rotary-factor": (_set(partial_rotary_factor=0.5, rope_parameters={"rope_theta": 1e4, "rope_type": "default",
                                                                                "partial_rotary_factor": 0.5}),
                              "partial_rotary_factor"),
    "unknown-architecture": (_set(architectures=["GPT2LMHeadModel"], model_type="gpt2"), "architectures"),
    "unknown-model-type-alone": (_config(lambda c: (c.pop("architectures"), c.update(model_type="gemma"))), "model_type"),
    "model-type-disagrees": (_set(model_type="qwen2"), "model_type"),
    "hf-quantization-config": (_set(quantization_config={"quant_method": "gptq", "bits": 4}), "quantization_config"),
    "unknown-minillm-quantization": (_set(quantization={"method": "int3"}), "quantization"),
    "attention-bias-without-tensors": (_set(attention_bias=True), "self_attn.q_proj.bias"),
    "tied-flag-not-a-bool": (_set(tie_word_embeddings="no"), "tie_word_embeddings"),
    "tied-but-the-head-is-its-own": (_set(tie_word_embeddings=True), "tie_word_embeddings"),
    "eos-not-an-id": (_set(eos_token_id="</s>"), "eos_token_id"),
    "not-json": (lambda d: (d / "config.json").write_text('{"hidden_size": 64,'), "config.json"),
    "a-json-list": (lambda d: (d / "config.json").write_text("[1, 2]"), "config.json"),
}


# ---- GGUF ------------------------------------------------------------------------------------------------
def _gguf_from(**config_changes):
    """The tiny model written with metadata that disagrees with its tensors (or makes no sense)."""
    def make(good, path: Path):
        model = tiny_llama()
        for key, value in config_changes.items():
            setattr(model.config, key, value)
        write_llama_gguf(path, model)
    return make


def _gguf_bytes(edit, source="gguf"):
    def make(good, path: Path):
        path.write_bytes(edit(good[source].read_bytes()))
    return make


def _scribble_tensor_data(raw: bytes) -> bytes:
    """Random bytes over a stretch of the tensor data (the issue's "overwrite 1 MB" at this model's scale)."""
    start = len(raw) - 60_000
    noise = np.random.default_rng(0).integers(0, 256, 40_000, dtype=np.uint8).tobytes()
    return raw[:start] + noise + raw[start + len(noise):]


def _unsupported_arch(good, path: Path):
    write_llama_gguf(path, tiny_llama(), arch="gpt2")


GGUF_CASES = {
    "truncated": _gguf_bytes(lambda b: b[:len(b) // 2]),
    "not-gguf": _gguf_bytes(lambda b: b"GGML" + b[4:]),
    "tensor-data-scribbled-f32": _gguf_bytes(_scribble_tensor_data),
    "tensor-data-scribbled-q4_1": _gguf_bytes(_scribble_tensor_data, "q4_1"),
    "kv-heads-not-the-tensors": _gguf_from(num_key_value_heads=4),
    "layers-more-than-the-tensors": _gguf_from(num_hidden_layers=3),
    "block-count-2-to-the-31": _gguf_from(num_hidden_layers=2**31),                   # hung
    "zero-layers": _gguf_from(num_hidden_layers=0),
    "rms-eps-negative": _gguf_from(rms_norm_eps=-1.0),
    "unsupported-architecture": _unsupported_arch,
}


# ---- tokenizer and chat template files ---------------------------------------------------------------
def _tokenizer(edit):
    def corrupt(d: Path):
        t = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
        edit(t)
        (d / "tokenizer.json").write_text(json.dumps(t), encoding="utf-8")
    return corrupt


def _template(text):
    def corrupt(d: Path):
        c = json.loads((d / "tokenizer_config.json").read_text())
        c["chat_template"] = text
        (d / "tokenizer_config.json").write_text(json.dumps(c))
    return corrupt


def _first_vocab(t, value):
    t["model"]["vocab"][next(iter(t["model"]["vocab"]))] = value


TOKENIZER_CASES = {
    "not-json": lambda d: (d / "tokenizer.json").write_text('{"model": {', encoding="utf-8"),
    "truncated": lambda d: (d / "tokenizer.json").write_bytes((d / "tokenizer.json").read_bytes()[:500]),
    "a-json-list": lambda d: (d / "tokenizer.json").write_text("[]"),
    "wordpiece-model": _tokenizer(lambda t: t["model"].update(type="WordPiece")),
    "no-vocab": _tokenizer(lambda t: t["model"].pop("vocab")),
    "negative-id": _tokenizer(lambda t: _first_vocab(t, -5)),
    "id-a-trillion": _tokenizer(lambda t: _first_vocab(t, 10 ** 12)),
    "id-ten-million": _tokenizer(lambda t: _first_vocab(t, 10 ** 7)),                 # 24-99 s and 2.4 GB
    "merge-of-unknown-tokens": _tokenizer(lambda t: t["model"]["merges"].append(["zz", "qq"])),
    "merge-not-a-pair": _tokenizer(lambda t: t["model"]["merges"].append("a b c")),
    "added-token-without-content": _tokenizer(lambda t: t["added_tokens"][0].pop("content")),
    "unsupported-pre-tokenizer": _tokenizer(lambda t: t.update(pre_tokenizer={"type": "BertPreTokenizer"})),
    "unsupported-normalizer": _tokenizer(lambda t: t.update(normalizer={"type": "BertNormalizer"})),
    "tokenizer-config-not-json": lambda d: (d / "tokenizer_config.json").write_text("{oops"),
    "tokenizer-config-adds-eos": lambda d: (d / "tokenizer_config.json").write_text('{"add_eos_token": true}'),
    "template-does-not-parse": _template("{% for m in messages %}{{ m.content }"),
    "template-raises": _template("{{ raise_exception('this template refuses every conversation') }}"),
    "template-type-error": _template("{{ messages + 1 }}"),
    "more-tokens-than-the-model": _tokenizer(lambda t: t["added_tokens"].append(
        {"id": 400, "content": "<extra>", "special": True, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False})),
}


# ---- the sweep ---------------------------------------------------------------------------------------------
def _all_cases():
    for name, corrupt in SAFETENSORS_CASES.items():
        yield pytest.param("dir", corrupt, None, id=f"safetensors-{name}")
    for name, (corrupt, field) in CONFIG_CASES.items():
        yield pytest.param("dir", corrupt, field, id=f"config-{name}")
    for name, make in GGUF_CASES.items():
        yield pytest.param("gguf", make, None, id=f"gguf-{name}")
    for name, corrupt in TOKENIZER_CASES.items():
        yield pytest.param("dir", corrupt, None, id=f"tokenizer-{name}")


@pytest.fixture
def no_hang():
    """A case that runs past 30 s fails instead of hanging the suite."""
    def fail(*_):
        raise TimeoutError("this input hangs minillm")
    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _make(kind, corrupt, good, tmp_path) -> Path:
    if kind == "gguf":
        path = tmp_path / "model.gguf"
        corrupt(good, path)
        return path
    path = _copy(good, tmp_path)
    corrupt(path)
    return path


def _python_api(path: Path) -> MiniLLMError:
    """load + a chat generation: where each kind of error must surface."""
    with pytest.raises(MiniLLMError) as info:
        llm = minillm.load(str(path))
        llm.generate([{"role": "user", "content": PROMPT}], max_tokens=3)
    return info.value


@pytest.mark.filterwarnings("error::RuntimeWarning")         # no NumPy warnings before the one line either
@pytest.mark.parametrize("kind, corrupt, field", list(_all_cases()))
def test_corrupt_input_is_one_line_from_the_api_and_the_cli(kind, corrupt, field, good, tmp_path, no_hang):
    path = _make(kind, corrupt, good, tmp_path)
    error = _python_api(path)
    message = str(error)
    assert message and "\n" not in message, message
    if field is not None:                                             # config cases name their field
        assert field in message, message
    result = CliRunner().invoke(cli, ["generate", "--model", str(path), "--max-tokens", "3", "--chat", PROMPT])
    assert result.exit_code not in (0, None), result.output
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("minillm: error: "), result.stderr
    assert "Traceback" not in result.output


def test_the_good_files_load_and_generate(good):
    """The control: without corruption every path above works (else the sweep could pass vacuously)."""
    for path in (good["dir"], good["gguf"], good["q4_1"]):
        g = minillm.load(str(path)).generate([{"role": "user", "content": PROMPT}], max_tokens=3)
        assert len(g.token_ids) >= 1
    result = CliRunner().invoke(cli, ["generate", "--model", str(good["dir"]), "--max-tokens", "3", "--chat", PROMPT])
    assert result.exit_code == 0, result.output


# ---- what the messages say ------------------------------------------------------------------------------
def test_nan_weights_name_the_tensor_and_the_position(good, tmp_path):
    path = _copy(good, tmp_path)
    _nan_tensor("model.layers.0.mlp.down_proj.weight")(path)
    with pytest.raises(MiniLLMError, match=r"NaN/Inf at position \d+.*weight model\.layers\.0\.mlp\.down_proj\.weight"):
        minillm.load(str(path)).logits([5, 6, 7])


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_overflowing_activations_are_told_apart_from_nan_weights(good, tmp_path):
    """Finite but absurd weights overflow fp32: the error says every weight is finite."""
    path = _copy(good, tmp_path)
    header, data = _read_st(path / "model.safetensors")
    begin, end = header["model.layers.0.mlp.up_proj.weight"]["data_offsets"]
    data = data[:begin] + np.full((end - begin) // 4, 3e38, np.float32).tobytes() + data[end:]
    _write_st(path / "model.safetensors", header, data)
    llm = minillm.load(str(path))
    with pytest.raises(MiniLLMError, match="every weight is finite"):
        llm.generate("hello", max_tokens=2)


def test_scribbled_gguf_names_the_tensor(good, tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(_scribble_tensor_data(good["q4_1"].read_bytes()))
    with pytest.raises(MiniLLMError, match=r"tensor \S+ holds \d+ NaN/Inf values"):
        minillm.load(str(path))


def test_config_refusals_are_config_errors_naming_the_field():
    base = ModelConfig(vocab_size=10, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=16).to_hf()
    for change, field in [({"hidden_act": "relu"}, "hidden_act"), ({"num_hidden_layers": True}, "num_hidden_layers"),
                          ({"rope_scaling": {"type": "yarn", "factor": 4}}, "rope_type"),
                          ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                            "layer_types": ["sliding_attention"], "use_sliding_window": True, "sliding_window": 4,
                            "num_hidden_layers": 2}, "layer_types")]:
        with pytest.raises(ConfigError, match=field):
            ModelConfig.from_hf(base | change)


def test_fields_of_the_wrong_type_are_config_errors_naming_them():
    """Each config.json field minillm reads is type-checked, not read as a default (rope_parameters="llama3"
    ran at theta 10000) or as Python truth ("false" is true)."""
    from test_moe import deepseek_moe_config, mixtral_config
    llama = ModelConfig(vocab_size=10, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=16).to_hf()
    mixtral = mixtral_config().to_dict() | {"architectures": ["MixtralForCausalLM"]}
    deepseek = deepseek_moe_config().to_dict() | {"architectures": ["DeepseekV3ForCausalLM"]}
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64}
    for base in (llama, mixtral, deepseek, deepseek | {"rope_parameters": yarn}):
        ModelConfig.from_hf(base)                                          # the controls load
    for base, change, field in [
            (llama, {"rope_parameters": "llama3"}, "rope_parameters"),
            (llama, {"rope_parameters": ["default", 1e4]}, "rope_parameters"),
            (llama, {"torch_dtype": ["float16"]}, "torch_dtype"),
            (llama, {"quantization": {"method": "fp8", "block": ["128", 128]}}, "quantization"),
            (llama, {"architectures": [{"LlamaForCausalLM": 1}]}, "architectures"),
            (mixtral, {"num_local_experts": "4"}, "num_local_experts"),
            (mixtral, {"num_experts_per_tok": 1.5}, "num_experts_per_tok"),
            (deepseek, {"norm_topk_prob": "false"}, "norm_topk_prob"),
            (deepseek, {"routed_scaling_factor": "2.5"}, "routed_scaling_factor"),
            (deepseek, {"first_k_dense_replace": 0.5}, "first_k_dense_replace"),
            (deepseek, {"n_shared_experts": "1"}, "n_shared_experts"),
            (deepseek, {"scoring_func": ["sigmoid"]}, "scoring_func"),
            (deepseek, {"rope_parameters": yarn | {"factor": "4"}}, "rope_scaling.factor"),
            (deepseek, {"rope_parameters": yarn | {"mscale": "1"}}, "rope_scaling.mscale"),
            (deepseek, {"rope_parameters": {k: v for k, v in yarn.items() if k != "original_max_position_embeddings"}},
             "rope_scaling.original_max_position_embeddings")]:
        with pytest.raises(ConfigError, match=field):
            ModelConfig.from_hf(base | change)


def test_mistral_and_qwen2_ignore_the_bias_flags_as_hf_does():
    """HF's Mistral has no biases whatever attention_bias says (and Qwen2 always has q/k/v ones)."""
    base = ModelConfig(vocab_size=10, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=16).to_hf()
    mistral = ModelConfig.from_hf(base | {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
                                          "attention_bias": True})
    qwen2 = ModelConfig.from_hf(base | {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                                        "attention_bias": False})
    assert (mistral.qkv_bias, mistral.o_bias) == (False, False)
    assert (qwen2.qkv_bias, qwen2.o_bias) == (True, False)


def test_smollm2_gguf_with_a_megabyte_scribbled_is_one_line(smollm2_gguf, tmp_path):
    """The issue's reproduction: 1 MB of the real SmolLM2 GGUF's tensor data overwritten."""
    start = 4 << 20                          # past the 1.8 MB of metadata: inside token_embd's Q4_1 blocks
    raw = bytearray(smollm2_gguf.read_bytes())
    raw[start:start + (1 << 20)] = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    bad = tmp_path / "smollm2-scribbled.gguf"
    bad.write_bytes(bytes(raw))
    result = CliRunner().invoke(cli, ["generate", "--model", str(bad), "--max-tokens", "4", "Hello"])
    assert result.exit_code == 1, result.output
    assert result.stderr.strip().startswith("minillm: error: ") and "NaN/Inf" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


# ---- a chat template that breaks its sandbox is refused at load, not at the first chat -------------------
SANDBOX_TEMPLATES = {
    "forbidden-attribute": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "sandbox forbids"),
    "huge-repeat": ("{% for m in messages %}{{ m.content * 10**9 }}{% endfor %}", "repeats a sequence"),
    "huge-output": ("{% for i in range(100000) %}{{ 'y' * 50000 }}{% endfor %}", "wrote more than"),
    "endless-loop": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                     "ran longer than 0.3 s"),
    "range-too-big": ("{% for i in range(10**12) %}{% endfor %}", "sandbox forbids: Range too big"),
    # only a conversation with a system turn reaches the bad branch: the second probe has one
    "in-the-system-branch": ("{% for m in messages %}{% if m.role == 'system' %}{{ 'a'.center(10**9) }}"
                             "{% endif %}{{ m.content }}{% endfor %}", "pads a string"),
}


@pytest.mark.parametrize("name", SANDBOX_TEMPLATES)
def test_a_template_that_breaks_its_sandbox_is_refused_at_load(name, good, tmp_path, monkeypatch, no_hang):
    from minillm.checkpoints import chat_template
    monkeypatch.setattr(chat_template, "LIMITS", chat_template.TemplateLimits(timeout_s=0.3))
    template, fragment = SANDBOX_TEMPLATES[name]
    path = _copy(good, tmp_path)
    _template(template)(path)
    with pytest.raises(MiniLLMError, match=fragment) as e:
        minillm.load(str(path))                       # the load itself refuses: no chat was asked for
    message = str(e.value)
    assert "\n" not in message and "probe conversation at load" in message and str(path) in message, message

    import minillm.serve.server as server             # `minillm serve` stops before it binds a port
    monkeypatch.setattr(server, "serve", lambda *a, **k: pytest.fail("the server started"))
    result = CliRunner().invoke(cli, ["serve", "--model", str(path), "--port", "8123"])
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("minillm: error: ") and fragment in lines[0], result.stderr


def test_a_template_that_refuses_a_probe_still_loads(good, tmp_path):
    """Refusing a conversation is a template's right (Mistral's and Gemma's refuse a system turn):
    such a template loads, and the refusal comes with the conversation it refuses."""
    path = _copy(good, tmp_path)
    _template("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system role') }}"
              "{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")(path)
    llm = minillm.load(str(path))
    assert len(llm.generate([{"role": "user", "content": PROMPT}], max_tokens=2).token_ids) >= 1
    with pytest.raises(MiniLLMError, match="no system role"):
        llm.generate([{"role": "system", "content": "x"}, {"role": "user", "content": PROMPT}], max_tokens=2)
