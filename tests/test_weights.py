"""weights.py (safetensors, HF dirs) and gguf_import.py (GGUF -> HF names), checked against transformers."""
import json
import struct

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import quantize
from transformers import LlamaConfig, LlamaForCausalLM

from minillm.errors import MiniLLMError
from minillm.checkpoints.gguf_import import load_gguf
from minillm.checkpoints.weights import (bf16_to_f32, f32_to_bf16, load_hf_dir, read_safetensors, save_hf_dir,
                             write_safetensors)


# ---- helpers (test_pull.py imports these too) -----------------------------------------------------
def tiny_llama(tie: bool = False, seed: int = 0) -> LlamaForCausalLM:
    """A random GQA Llama small enough to run in milliseconds; widths are multiples of 32 (GGUF blocks)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=272, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                         rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=tie,
                         bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # HF initialises norms to exactly 1; random gains catch a mixed-up norm
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def byte_level_vocab() -> tuple[list[str], list[str]]:
    """A GPT-2-style vocabulary: 3 specials, the 256 byte symbols, a few merges (272 tokens)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for b in range(256):  # GPT-2's byte -> printable unicode map: unprintable bytes move to 256+
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    merges = ["h e", "l l", "o Ġ", "he ll", "Ġ w", "o r", "l d", "Ġw or", "hell o", "Ġwor ld", "e r", "i n", "t h"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [symbols[b] for b in range(256)]
    tokens += ["".join(m.split()) for m in merges]
    return tokens, merges


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert script does to attn_q/attn_k rows (halves -> adjacent pairs)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
              "post_attention_layernorm": "ffn_norm"}


def write_llama_gguf(path, model: LlamaForCausalLM, qtype: Q = Q.F32, arch: str = "llama") -> None:
    """Write an HF Llama as llama.cpp would: GGUF names, permuted Q/K rows, matrices in `qtype`."""
    c = model.config
    w = GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"] if hasattr(c, "rope_parameters") else c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    tokens, merges = byte_level_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))  # 3 = control, 1 = normal
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        a = t.numpy()
        if ".q_proj." in name:
            a = llama_cpp_permute(a, c.num_attention_heads)
        elif ".k_proj." in name:
            a = llama_cpp_permute(a, c.num_key_value_heads)
        if a.ndim == 2 and qtype != Q.F32:  # llama.cpp keeps norms in F32 and quantizes matrices
            w.add_tensor(gguf_name(name), quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, i, *part, _ = hf.split(".")
    return f"blk.{i}.{GGUF_NAMES['.'.join(part)]}.weight"


def hf_from_tensors(config_dict: dict, tensors: dict[str, np.ndarray]) -> LlamaForCausalLM:
    """An HF model whose weights are exactly `tensors` (float32)."""
    model = LlamaForCausalLM(LlamaConfig(**config_dict)).eval()
    state = {k: torch.from_numpy(np.asarray(v, dtype=np.float32).copy()) for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return model


def logits(model: LlamaForCausalLM, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


IDS = [1, 5, 77, 200, 3, 9, 150, 42]


@pytest.fixture(scope="module")
def hf_model():
    return tiny_llama()


@pytest.fixture(scope="module")
def hf_dir(hf_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    hf_model.save_pretrained(path)
    return path


# ---- bf16 ------------------------------------------------------------------------------------------
def test_bf16_rounding_matches_torch():
    x = np.random.default_rng(0).standard_normal(50_000).astype(np.float32) * 1e3
    x[:4] = [np.inf, -np.inf, 3.4e38, 1e-40]
    x[4:8] = np.array([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F807FFF], np.uint32).view(np.float32)  # ties
    torch_bits = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(f32_to_bf16(x), torch_bits)
    assert np.array_equal(bf16_to_f32(torch_bits), torch.from_numpy(x).to(torch.bfloat16).float().numpy())
    assert np.isnan(bf16_to_f32(f32_to_bf16(np.array([np.nan], np.float32))))[0]


# ---- safetensors -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_safetensors_round_trip(tmp_path, dtype):
    from safetensors.torch import load_file
    rng = np.random.default_rng(1)
    a = rng.standard_normal((7, 5)).astype(np.float32)
    stored = {"F32": a, "F16": a.astype(np.float16), "BF16": f32_to_bf16(a)}[dtype]
    write_safetensors(tmp_path / "t.safetensors", {"w": stored, "b": stored[0]})
    back = read_safetensors(tmp_path / "t.safetensors")
    assert back["w"].dtype == stored.dtype and np.array_equal(back["w"], stored)
    assert np.array_equal(back["b"], stored[0])
    # the reference reader agrees (torch has bf16, so it can check our BF16 bits)
    ref = load_file(tmp_path / "t.safetensors")["w"]
    assert str(ref.dtype) == {"F32": "torch.float32", "F16": "torch.float16", "BF16": "torch.bfloat16"}[dtype]
    expected = bf16_to_f32(stored) if dtype == "BF16" else stored.astype(np.float32)
    assert np.array_equal(ref.float().numpy(), expected)


def test_load_hf_dir_is_lazy_and_exact(hf_model, hf_dir):
    config, tensors = load_hf_dir(hf_dir)
    assert (config.n_heads, config.n_kv_heads, config.dim, config.n_layers) == (4, 2, 64, 2)
    state = hf_model.state_dict()
    assert set(tensors) == set(state)
    for name, t in state.items():
        assert np.array_equal(tensors[name], t.numpy()), name
    emb = tensors["model.embed_tokens.weight"]
    assert not emb.flags.owndata and isinstance(emb.base, np.memmap)  # a view of the mapped file


def test_sharded_checkpoint(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    _, tensors = load_hf_dir(tmp_path)
    for name, t in hf_model.state_dict().items():
        assert np.array_equal(tensors[name], t.numpy()), name
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(MiniLLMError, match=f"{shard.name}.*missing"):
        load_hf_dir(tmp_path)


@pytest.mark.parametrize("dtype", [None, "float16", "bfloat16"])
def test_saved_dir_loads_in_transformers(hf_model, hf_dir, tmp_path, dtype):
    config, tensors = load_hf_dir(hf_dir)
    save_hf_dir(tmp_path, config, tensors, dtype=dtype)
    again = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert str(again.dtype) == "torch." + (dtype or "float32")
    tol = {None: 0, "float16": 2e-2, "bfloat16": 1e-1}[dtype]
    np.testing.assert_allclose(logits(again.float(), IDS), logits(hf_model, IDS), atol=tol, rtol=0)


def test_tied_head_is_not_written(tmp_path):
    model = tiny_llama(tie=True)
    model.save_pretrained(tmp_path / "src")
    config, tensors = load_hf_dir(tmp_path / "src")
    assert config.tie_embeddings and "lm_head.weight" not in tensors
    save_hf_dir(tmp_path / "dst", config, {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]})
    assert "lm_head.weight" not in read_safetensors(tmp_path / "dst" / "model.safetensors")
    again = LlamaForCausalLM.from_pretrained(tmp_path / "dst").eval()
    np.testing.assert_array_equal(logits(again, IDS), logits(model, IDS))


# ---- corrupt files ---------------------------------------------------------------------------------
def _write_raw(path, header: bytes, data: bytes = b"", header_len: int | None = None):
    path.write_bytes(struct.pack("<Q", len(header) if header_len is None else header_len) + header + data)


def test_corrupt_safetensors_errors(tmp_path):
    f = tmp_path / "model.safetensors"
    _write_raw(f, b"{}", header_len=10**9)
    with pytest.raises(MiniLLMError, match="header length .* past the end"):
        read_safetensors(f)
    _write_raw(f, b"{not json")
    with pytest.raises(MiniLLMError, match="not valid JSON"):
        read_safetensors(f)
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}).encode()
    _write_raw(f, header, b"\0" * 30)  # 30 of the 64 data bytes: a download cut short
    with pytest.raises(MiniLLMError, match="model.safetensors: truncated: tensor w"):
        read_safetensors(f)
    f.write_bytes(b"abc")
    with pytest.raises(MiniLLMError, match="not a safetensors file"):
        read_safetensors(f)


_A = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
_B = {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}
LAYOUTS = {   # case: (header, data bytes)
    "in-order": ({"a": _A, "b": _B}, 32),
    "listed-out-of-order": ({"b": _B, "a": _A}, 32),
    "an-empty-tensor": ({"a": _A, "e": {"dtype": "F32", "shape": [0, 3], "data_offsets": [16, 16]}}, 16),
    "overlapping": ({"a": _A, "b": _B | {"data_offsets": [8, 24]}}, 32),
    "sharing-bytes": ({"a": _A, "b": _B | {"data_offsets": [0, 16]}}, 16),
    "gap-between": ({"a": _A, "b": _B | {"data_offsets": [20, 36]}}, 36),
    "gap-first": ({"b": _B | {"data_offsets": [8, 24]}}, 24),
    "bytes-after-the-last": ({"a": _A}, 24),
    "negative-dims": ({"a": _A | {"shape": [-2, -2]}}, 16),
    "fractional-dim": ({"a": _A | {"shape": [2.0, 2]}}, 16),
    "shape-overflowing-int64": ({"a": _A | {"shape": [2**62 + 1, 4]}}, 16),   # in int64, x4 wraps to 4 values
}


@pytest.mark.parametrize("case", LAYOUTS)
def test_header_is_checked_as_the_safetensors_library_checks_it(case, tmp_path):
    """The safetensors library is the peer: what it refuses, read_safetensors refuses in one line (tensors
    sharing bytes used to load as wrong weights); what it reads, read_safetensors reads the same."""
    from safetensors.numpy import load_file
    header, n_bytes = LAYOUTS[case]
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    f = tmp_path / "model.safetensors"
    f.write_bytes(struct.pack("<Q", len(blob)) + blob + np.arange(n_bytes, dtype=np.uint8).tobytes())
    try:
        expected = load_file(f)
    except Exception:                                   # the library's SafetensorError (or its own overflow check)
        expected = None
    if expected is None:
        with pytest.raises(MiniLLMError) as error:
            read_safetensors(f)
        assert "\n" not in str(error.value) and "model.safetensors" in str(error.value)
    else:
        mine = read_safetensors(f)
        assert sorted(mine) == sorted(expected)
        for name, a in expected.items():
            np.testing.assert_array_equal(mine[name], a)


def test_truncated_checkpoint_names_the_file(hf_dir, tmp_path):
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((hf_dir / name).read_bytes())
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(MiniLLMError, match=r"model\.safetensors: truncated"):
        load_hf_dir(tmp_path)


def test_missing_config_and_weights(hf_dir, tmp_path):
    (tmp_path / "model.safetensors").write_bytes((hf_dir / "model.safetensors").read_bytes())
    with pytest.raises(MiniLLMError, match="config.json: missing"):
        load_hf_dir(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "config.json").write_text((hf_dir / "config.json").read_text())
    with pytest.raises(MiniLLMError, match="no model.safetensors"):
        load_hf_dir(tmp_path)


# ---- GGUF import -----------------------------------------------------------------------------------
def test_gguf_f32_logits_match_hf(hf_model, tmp_path):
    """The strongest check of the Q/K un-permutation: identical logits from identical numbers."""
    write_llama_gguf(tmp_path / "m.gguf", hf_model)
    config, tensors = load_gguf(tmp_path / "m.gguf")
    assert config.tie_embeddings is False and config.torch_dtype == "float32"
    for name, t in hf_model.state_dict().items():
        assert np.array_equal(tensors[name], t.numpy()), name
    rebuilt = hf_from_tensors(config.to_hf(), tensors)
    np.testing.assert_allclose(logits(rebuilt, IDS), logits(hf_model, IDS), atol=1e-5, rtol=0)


@pytest.mark.parametrize("qtype, rel_err", [(Q.F16, 1e-3), (Q.BF16, 5e-3), (Q.Q8_0, 1e-2),
                                            (Q.Q4_1, 0.12), (Q.Q4_0, 0.15)])
def test_gguf_quantized_within_quant_error(hf_model, tmp_path, qtype, rel_err):
    write_llama_gguf(tmp_path / "m.gguf", hf_model, qtype)
    config, tensors = load_gguf(tmp_path / "m.gguf")
    for name, t in hf_model.state_dict().items():
        ref = t.numpy()
        err = np.linalg.norm(tensors[name] - ref) / np.linalg.norm(ref)
        assert err < rel_err, (name, err)
        if ref.ndim == 1:  # norms stay F32 in GGUF: exact
            assert np.array_equal(tensors[name], ref)


def test_gguf_tied_and_dtype_choice(tmp_path):
    model = tiny_llama(tie=True)
    write_llama_gguf(tmp_path / "m.gguf", model, Q.Q8_0)
    config, tensors = load_gguf(tmp_path / "m.gguf", dtype="float16")
    assert config.tie_embeddings and "lm_head.weight" not in tensors
    assert all(t.dtype == np.float16 for t in tensors.values()) and config.torch_dtype == "float16"
    _, bf16 = load_gguf(tmp_path / "m.gguf", dtype="bfloat16")
    assert all(t.dtype == np.uint16 for t in bf16.values())


def test_gguf_default_dtype_is_float16_for_big_models():
    from minillm.model.config import PRESETS
    from minillm.checkpoints.gguf_import import default_dtype
    assert default_dtype(PRESETS["smollm2-135m"].config) == "float32"
    assert default_dtype(PRESETS["mistral-7b"].config) == "float16"


def test_gguf_errors(hf_model, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\3\4 definitely a zip")
    with pytest.raises(MiniLLMError, match="not a GGUF file"):
        load_gguf(bad)
    write_llama_gguf(tmp_path / "m.gguf", hf_model, Q.Q8_0)
    data = (tmp_path / "m.gguf").read_bytes()
    for cut in (100, len(data) - 1000):  # inside the metadata; inside the last tensor
        bad.write_bytes(data[:cut])
        with pytest.raises(MiniLLMError, match="bad.gguf: truncated or corrupt"):
            load_gguf(bad)
    write_llama_gguf(tmp_path / "q.gguf", hf_model, arch="qwen2")
    with pytest.raises(MiniLLMError, match="unsupported GGUF architecture 'qwen2'"):
        load_gguf(tmp_path / "q.gguf")
    with pytest.raises(MiniLLMError, match="file not found"):
        load_gguf(tmp_path / "nope.gguf")


# ---- the real SmolLM2 file (pulled once per cache, see conftest.py) --------------------------------
def test_smollm2_config_matches_preset(smollm2_dir):
    from minillm.model.config import PRESETS
    config, tensors = load_hf_dir(smollm2_dir)
    assert config == PRESETS["smollm2-135m"].config.replace(torch_dtype="float32")
    assert len(tensors) == 2 + 9 * 30 and "lm_head.weight" not in tensors  # tied head


def test_smollm2_converted_dir_matches_hf_gguf_loader(smollm2_hf_dir, smollm2_gguf):
    ours = LlamaForCausalLM.from_pretrained(smollm2_hf_dir).eval()
    theirs = LlamaForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name,
                                              dtype=torch.float32).eval()
    ids = [1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 2]
    np.testing.assert_allclose(logits(ours, ids), logits(theirs, ids), atol=1e-4, rtol=0)


# ---- convert ---------------------------------------------------------------------------------------
def test_convert_gguf_then_transformers_loads_it(hf_model, tmp_path):
    from minillm.checkpoints.convert import convert
    write_llama_gguf(tmp_path / "m.gguf", hf_model)
    convert(tmp_path / "m.gguf", tmp_path / "out", progress=False)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (tmp_path / "out").iterdir()}
    again = LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    np.testing.assert_allclose(logits(again, IDS), logits(hf_model, IDS), atol=1e-5, rtol=0)


def test_convert_hf_dir_casts_and_copies_tokenizer_files(hf_dir, tmp_path):
    from minillm.checkpoints.convert import convert
    src = tmp_path / "src"
    src.mkdir()
    for f in hf_dir.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    (src / "tokenizer.json").write_text('{"model": {}}')
    convert(src, tmp_path / "out", progress=False, dtype="bfloat16")
    config, tensors = load_hf_dir(tmp_path / "out")
    assert config.torch_dtype == "bfloat16" and all(t.dtype == np.uint16 for t in tensors.values())
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"model": {}}'
    with pytest.raises(MiniLLMError, match="its own source"):
        convert(src, src, progress=False)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("n_tokens", [1, 7])
def test_16_bit_weights_multiply_a_block_at_a_time_like_the_whole_widened_matrix(dtype, n_tokens, monkeypatch):
    from minillm import backend
    from minillm.model.layers import linear
    rng = np.random.default_rng(3)
    w = backend.to_dtype(rng.standard_normal((301, 64)).astype(np.float32), dtype)     # bf16 bits or fp16
    x = rng.standard_normal((n_tokens, 64)).astype(np.float32)
    monkeypatch.setattr(backend, "WIDEN_BYTES", 40 * 64 * 4)                      # 40 rows a block, a short last one
    expected = x @ backend.as_f32(w).T
    np.testing.assert_allclose(linear(x, w), expected, rtol=0, atol=2e-6 * np.abs(expected).max())
