"""dev/qfloor.py's kernel variants, on the CPU: each is gemv_quant.cu with exactly the part it names taken out
(the patterns it edits still occur once) or its #defines changed, and compiles for Hopper."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from minillm.cuda.dev import qfloor


def test_each_edit_takes_out_only_what_it_names():
    plain = qfloor.variant_source()
    assert qfloor.STAGE in plain
    no_stage = qfloor.variant_source(no_stage=True)
    assert qfloor.STAGE not in no_stage and no_stage.replace("float ss = 1.0f;", qfloor.STAGE) == plain
    no_math = qfloor.variant_source(no_math=True)
    assert no_math.count("vb[u].x ^ vb[u].y") == 2 and "dot4_i8_h2(va[u].x" in plain
    assert "dot4_i8_h2(va[u].x" not in no_math and "dot8_i4_h2(va[u].x" not in no_math
    no_prefetch = qfloor.variant_source(no_prefetch=True)
    assert qfloor.FIRST_PREFETCH in plain and qfloor.FIRST_PREFETCH not in no_prefetch
    assert no_prefetch.replace("/* no prefetch before the staging */", qfloor.FIRST_PREFETCH) == plain


def test_the_defines_the_variants_change_are_the_kernels_own():
    """A -D for a name the kernel does not #ifndef would change nothing and measure v2 twice."""
    plain = qfloor.variant_source()
    for _, defines in qfloor.VARIANTS.values():
        for name in defines:
            assert f"#ifndef {name}" in plain, name
    assert qfloor.compile_options({"Q_WARPS": 16}) == ("--std=c++17", "-DQ_WARPS=16")
    assert set(qfloor.EXACT) <= set(qfloor.VARIANTS)


def test_a_kernel_that_changed_is_named_not_silently_measured():
    with pytest.raises(ValueError, match="no longer has exactly one"):
        qfloor._replace_once("no such line", qfloor.STAGE, "")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("label", ["neither", "16 + batched", "int4 4 blocks"])
def test_variant_compiles_with_nvcc_for_sm90(label, tmp_path):
    """To PTX (the front end, where an edit or a define would break): ptxas on the defaults is
    test_kernels_compile's, and half the CI seconds of a full compile."""
    edits, defines = qfloor.VARIANTS[label]
    source = tmp_path / "variant.cu"
    source.write_text(qfloor.variant_source(**edits))
    result = subprocess.run(["nvcc", "-arch=sm_90", *qfloor.compile_options(defines),
                             "-ptx", str(source), "-o", str(tmp_path / "v.ptx")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_an_unknown_variant_is_refused_in_one_line(capsys):
    assert qfloor.main(["--variants", "no staging,sideways"]) == 2
    assert capsys.readouterr().err.strip() == (
        "qfloor: no variant sideways (there are: " + ", ".join(qfloor.VARIANTS) + ")")


def test_a_variant_for_one_kernel_routes_only_that_kernels_launches(monkeypatch):
    """'3 blocks qkv only': the q|k|v GEMV launches from the variant's Kernels (its functions and grid), every
    other quantized GEMV from the default's."""
    from minillm.cuda.kernels import Kernels

    class Stub:
        def __init__(self, label):
            self.label, self.fn = label, {}
    calls = []
    monkeypatch.setattr(Kernels, "_quant", lambda self, name, *args, **kwargs: calls.append((self.label, name)))
    default, variant = Stub("default"), Stub("variant")
    routed = qfloor._routed(default, variant, qfloor.ONLY["3 blocks qkv only"])
    for name in ("gemv_qkv_v4", "gemv_v4", "gemv_swiglu_v4"):
        routed._quant(name, "w", "x")
    assert calls == [("variant", "gemv_qkv_v4"), ("default", "gemv_v4"), ("default", "gemv_swiglu_v4")]
    assert qfloor.VARIANTS["3 blocks qkv only"] == qfloor.VARIANTS["3 blocks"]


def test_the_routed_variants_are_variants():
    assert set(qfloor.ONLY) <= set(qfloor.VARIANTS)
