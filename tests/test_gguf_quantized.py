"""GGUF files kept quantized (checkpoints/gguf_quantized.py, model/ggml_blocks.py), on files llama.cpp's own
converter wrote from a random HF Llama (tests/llama_cpp_converter.py), against HF transformers: on the source
checkpoint, within the quantization's error, and reading the same GGUF itself (gguf-py's dequantize, its own
Q/K row order), to float32 rounding. Q4_0/Q4_1/Q5_0 files are the converter's f32 output quantized by
gguf-py's quants.py; gguf-py cannot quantize to Q4_K/Q6_K/Q5_K, so those files hold random blocks
(llama.cpp's byte layouts, plausible scales), which only the peer reading the same file can check."""
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from hf_models import hf_logits
from llama_cpp_converter import alone, save_tiny_llama
from test_pull import FakeHub, tiny_preset, weights_root  # noqa: F401  (fixtures: a fake hub, a tiny preset)
from minillm.checkpoints import gguf_quantized
from minillm.checkpoints.gguf_quantized import load_gguf_for_cpu, load_path
from minillm.cli import cli
from minillm.errors import MiniLLMError
from minillm.model.ggml_blocks import GGMLWeight
from minillm.model.quant import Int4Weight, QuantizedWeight
from minillm.model.transformer import Transformer

IDS = [1, 40, 200, 7, 280, 19, 3, 100, 261, 262, 5, 9, 77, 150, 33, 288, 12, 4, 60, 70]   # 20 > DOT_ROWS: prefill tiles


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(folder, HF model) of a random 2-layer Llama the converter accepts (widths multiples of 256)."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    return folder, save_tiny_llama(folder).eval()


@pytest.fixture(scope="module")
def converted(source, llama_cpp_convert, tmp_path_factory):
    """{"q8_0": path, "f32": path}: the converter's output for the source checkpoint."""
    out = tmp_path_factory.mktemp("converted")
    return {kind: llama_cpp_convert(source[0], out / f"tiny-{kind}.gguf", kind) for kind in ("q8_0", "f32")}


def requantize(src, dst, types: dict, seed: int = 0):
    """Copy the GGUF `src` to `dst` with gguf-py, each tensor whose name holds a key of `types` stored as
    that type: gguf-py's own quantizer where it has one, else random blocks of the type (K-quants)."""
    import gguf
    from gguf.constants import GGMLQuantizationType as Q
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, str(reader.fields["general.architecture"].contents()))
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    rng = np.random.default_rng(seed)
    for t in reader.tensors:
        kind = next((Q[k] for part, k in types.items() if part in t.name), None)
        data = np.array(t.data)
        if kind is None or data.ndim != 2:
            writer.add_tensor(t.name, data)
            continue
        try:
            blocks = gguf.quants.quantize(data, kind)
        except NotImplementedError:
            blocks = random_blocks(kind, data.shape, rng)
        writer.add_tensor(t.name, blocks, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def random_blocks(kind, shape, rng) -> np.ndarray:
    """Random blocks of a K-quant for a matrix [out, in], their fp16 super-block scales small enough that
    the weights are of a trained layer's size (|w| of a few hundredths)."""
    from gguf.constants import GGML_QUANT_SIZES
    block, block_bytes = GGML_QUANT_SIZES[kind]
    out = rng.integers(0, 256, (shape[0], shape[1] // block, block_bytes), dtype=np.uint8)
    scale_at = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[kind.name]
    for at in scale_at:
        d = rng.uniform(2e-5, 6e-5, out.shape[:2]).astype(np.float16)
        out[..., at:at + 2] = d.view(np.uint8).reshape(*out.shape[:2], 2)
    return out.reshape(shape[0], -1)


def hf_from_gguf(path, folder):
    """HF transformers' model read from the GGUF itself (gguf-py dequantizes, transformers undoes Q/K order)."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(alone(path, folder), gguf_file=path.name, dtype=torch.float32).eval()


def minillm_logits(config, tensors, ids=IDS):
    model = Transformer(config, tensors)
    return model.prefill(ids, model.new_cache(len(ids) + 1), all_logits=True)


def decode_logits(config, tensors, ids=IDS):
    """The last position's logits from a decode step (one row of x: the matmuls' sub-block path)."""
    model = Transformer(config, tensors)
    cache = model.new_cache(len(ids) + 1)
    model.prefill(ids[:-1], cache)
    return model.decode(ids[-1], cache)


def matrices(tensors) -> dict:
    return {name: w for name, w in tensors.items() if name.endswith("_proj.weight") or name == "lm_head.weight"}


def test_q8_0_from_the_converter_stays_q8_0_and_gives_hfs_logits(converted, source, tmp_path):
    config, tensors = load_gguf_for_cpu(converted["q8_0"], how="kept")
    kept = matrices(tensors)
    assert len(kept) == 2 * 7 + 1 and all(isinstance(w, GGMLWeight) and w.kind == "Q8_0" for w in kept.values())
    ours = minillm_logits(config, tensors)
    peer = hf_from_gguf(converted["q8_0"], tmp_path / "hf")
    np.testing.assert_allclose(ours, hf_logits(peer, IDS), atol=1e-4)
    np.testing.assert_allclose(decode_logits(config, tensors), hf_logits(peer, IDS)[-1], atol=1e-4)
    # and against the checkpoint it was converted from: Q8_0's rounding only
    np.testing.assert_allclose(ours, hf_logits(source[1], IDS), atol=0.05)


def test_q4_0_and_q4_1_load_as_int4_groups_of_32_exactly(converted, source, tmp_path):
    path = requantize(converted["f32"], tmp_path / "q4.gguf",
                      {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q4_0", "attn_output": "Q4_1",
                       "ffn_gate": "Q4_0", "ffn_up": "Q4_1", "ffn_down": "Q4_0"})
    config, tensors = load_gguf_for_cpu(path, how="kept")
    peer = hf_from_gguf(path, tmp_path / "hf")
    reference = {name: p.detach().numpy() for name, p in peer.state_dict().items()}
    layers = {n: w for n, w in matrices(tensors).items() if n != "lm_head.weight"}
    assert len(layers) == 14
    for name, w in layers.items():
        assert isinstance(w, Int4Weight) and w.group_size == 32, name
        np.testing.assert_array_equal(w.dequantize(), reference[name], err_msg=name)   # bit for bit
    ours = minillm_logits(config, tensors)
    np.testing.assert_allclose(ours, hf_logits(peer, IDS), atol=1e-4)
    np.testing.assert_allclose(decode_logits(config, tensors), hf_logits(peer, IDS)[-1], atol=1e-4)
    np.testing.assert_allclose(ours, hf_logits(source[1], IDS), atol=0.5)     # 4-bit rounding of the source


def test_q4_k_and_q6_k_keep_their_blocks_and_give_hfs_logits(converted, tmp_path):
    path = requantize(converted["f32"], tmp_path / "k.gguf",       # a Q4_K_M's mix: Q6_K for v, down, output
                      {"attn_v": "Q6_K", "ffn_down": "Q6_K", "output.weight": "Q6_K", "blk.": "Q4_K"})
    config, tensors = load_gguf_for_cpu(path, how="kept")
    peer = hf_from_gguf(path, tmp_path / "hf")
    reference = {name: p.detach().numpy() for name, p in peer.state_dict().items()}
    kinds = {name: w.kind for name, w in matrices(tensors).items()}
    assert kinds["model.layers.1.self_attn.v_proj.weight"] == kinds["lm_head.weight"] == "Q6_K"
    assert kinds["model.layers.0.self_attn.q_proj.weight"] == kinds["model.layers.1.mlp.up_proj.weight"] == "Q4_K"
    for name, w in matrices(tensors).items():
        assert w.blocks.base is not None, name            # a view of the file: no copy, no float detour
        np.testing.assert_array_equal(w.dequantize(), reference[name], err_msg=name)
    expected = hf_logits(peer, IDS)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(minillm_logits(config, tensors), expected, atol=1e-5 * scale)
    np.testing.assert_allclose(decode_logits(config, tensors), expected[-1], atol=1e-5 * scale)


def test_other_types_are_dequantized_with_a_one_line_note(converted, tmp_path, capsys):
    path = requantize(converted["f32"], tmp_path / "q5.gguf", {"ffn_down": "Q5_K", "blk.": "Q4_K"})
    config, tensors = load_gguf_for_cpu(path, how="kept")
    note = capsys.readouterr().err
    assert note.count("\n") == 1 and "Q5_K layer matrices are dequantized to float32 at load" in note
    down = tensors["model.layers.0.mlp.down_proj.weight"]
    assert not isinstance(down, QuantizedWeight) and down.dtype == np.float32
    assert load_path(tensors) == "kept quantized (Q4_K 12 matrices); 3 in float"      # 2 Q5_K, the F32 head
    expected = hf_logits(hf_from_gguf(path, tmp_path / "hf"), IDS)
    np.testing.assert_allclose(minillm_logits(config, tensors), expected, atol=1e-5 * np.abs(expected).max())


def test_a_float_copy_that_would_not_fit_is_refused_in_one_line(converted, tmp_path, monkeypatch):
    path = requantize(converted["f32"], tmp_path / "q5.gguf", {"ffn_down": "Q5_K", "blk.": "Q4_K"})
    monkeypatch.setattr(gguf_quantized, "available_memory", lambda: 10**6)     # 1 MB free
    result = CliRunner().invoke(cli, ["info", str(path)])
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1 and "Q5_K tensors would take" in result.stderr
    assert "1.0 MB" not in result.stderr and "GB of memory is available" in result.stderr


def test_auto_keeps_the_file_quantized_when_float32_would_not_fit_and_info_says_so(converted, monkeypatch):
    config, _ = load_gguf_for_cpu(converted["q8_0"], how="float")
    info = CliRunner().invoke(cli, ["info", str(converted["q8_0"])])
    assert info.exit_code == 0 and "load path              float: every matrix dequantized at load" in info.output
    # less memory than the float32 model, enough for its embedding and norms: the file stays Q8_0
    monkeypatch.setattr(gguf_quantized, "available_memory", lambda: 2 * config.n_params)
    _, tensors = load_gguf_for_cpu(converted["q8_0"])
    assert all(isinstance(w, GGMLWeight) for w in matrices(tensors).values())
    info = CliRunner().invoke(cli, ["info", str(converted["q8_0"])])
    assert "load path              kept quantized (Q8_0 15 matrices)" in info.output


# ---- `minillm pull NAME --gguf QUANT` from a fake hub on 127.0.0.1 (tests/test_pull.py's) ----------------


@pytest.fixture
def gguf_hub(converted, tiny_preset, weights_root, tmp_path, monkeypatch):
    """The converter's Q8_0 file served as the tiny-test preset's pinned GGUF."""
    import hashlib
    from minillm.checkpoints import pull as pulling
    repo = tmp_path / "gguf-repo"
    repo.mkdir()
    (repo / "tiny.Q8_0.gguf").write_bytes(converted["q8_0"].read_bytes())
    hub = FakeHub("test-org/tiny-gguf", repo)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    sha256 = hashlib.sha256(hub.files["tiny.Q8_0.gguf"]).hexdigest()
    monkeypatch.setitem(pulling.GGUF_PINS, "tiny-test",
                        {"Q8_0": pulling.GGUFPin(hub.repo, hub.sha, "tiny.Q8_0.gguf", sha256)})
    yield hub
    hub.close()


def test_pull_gguf_fetches_the_pinned_file_and_generate_takes_it_when_16_bit_does_not_fit(
        gguf_hub, source, weights_root, monkeypatch):
    from minillm.checkpoints import pull as pulling
    result = CliRunner().invoke(cli, ["pull", "tiny-test", "--gguf", "Q8_0"])
    assert result.exit_code == 0, result.output
    pulled = weights_root / "tiny-test" / "gguf" / "tiny.Q8_0.gguf"
    assert pulled.read_bytes() == gguf_hub.files["tiny.Q8_0.gguf"]
    assert all(path.startswith(f"/test-org/tiny-gguf/resolve/{gguf_hub.sha}/")
               for _, path in gguf_hub.requests if "/resolve/" in path)              # at the pinned commit
    assert pulling.resolve("tiny-test") == pulled                   # no 16-bit weights: the GGUF
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (weights_root / "tiny-test" / name).write_bytes((source[0] / name).read_bytes())
    assert pulling.resolve("tiny-test") == weights_root / "tiny-test"    # they fit: the 16-bit weights
    sixteen_bit = (source[0] / "model.safetensors").stat().st_size
    monkeypatch.setattr(gguf_quantized, "available_memory", lambda: sixteen_bit // 2)
    result = CliRunner().invoke(cli, ["generate", "--model", "tiny-test", "--max-tokens", "3", "the"])
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stderr.splitlines() if "using its GGUF" in line]
    assert notes == [f"minillm: note: tiny-test's 16-bit weights ({sixteen_bit / 1e9:.1f} GB) do not fit in the "
                     f"{sixteen_bit / 2e9:.1f} GB of memory available: using its GGUF, tiny.Q8_0.gguf"]


def test_pull_gguf_refuses_other_bytes_and_unpinned_quantizations(gguf_hub, weights_root):
    data = gguf_hub.files["tiny.Q8_0.gguf"]
    gguf_hub.served["tiny.Q8_0.gguf"] = data[:-1] + bytes([data[-1] ^ 1])
    result = CliRunner().invoke(cli, ["pull", "tiny-test", "--gguf", "Q8_0"])
    (error,) = [line for line in result.stderr.splitlines() if not line.startswith("downloading ")]
    assert result.exit_code == 1 and error.startswith("minillm: error: ") and "not the pinned" in error
    assert not list((weights_root / "tiny-test").rglob("*.gguf"))
    result = CliRunner().invoke(cli, ["pull", "tiny-test", "--gguf", "Q4_K_M"])
    assert result.exit_code == 1 and "no pinned Q4_K_M GGUF for 'tiny-test'" in result.stderr


def test_a_nan_block_scale_is_refused_at_load_in_one_line(converted, tmp_path):
    import gguf
    path = requantize(converted["f32"], tmp_path / "k.gguf", {"blk.": "Q4_K"})
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.1.ffn_up.weight")
    data = bytearray(path.read_bytes())
    data[tensor.data_offset + 144 * 3:tensor.data_offset + 144 * 3 + 2] = np.float16(np.nan).tobytes()   # block 3's d
    path.write_bytes(bytes(data))
    with pytest.raises(MiniLLMError, match="tensor blk.1.ffn_up.weight has NaN/Inf block scales"):
        load_gguf_for_cpu(path, how="kept")
