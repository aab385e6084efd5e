"""dev/qfloor.py's kernel variants, on the CPU: each is gemv_quant.cu with exactly the part it names taken out
(the patterns it edits still occur once), and compiles for Hopper."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from minillm.cuda.dev import qfloor


def test_each_variant_changes_only_what_it_names():
    plain = qfloor.variant_source()
    assert qfloor.STAGE in plain and qfloor.WARPS in plain
    no_stage = qfloor.variant_source(no_stage=True)
    assert qfloor.STAGE not in no_stage and "float ss = 1.0f;" in no_stage
    assert len(no_stage) < len(plain) and no_stage.replace("float ss = 1.0f;", qfloor.STAGE) == plain
    no_math = qfloor.variant_source(no_math=True)
    assert no_math.count("vb[u].x ^ vb[u].y") == 2 and "dot4_i8_h2(va[u].x" not in no_math
    assert "dot8_i4_h2(va[u].x" not in no_math and "dot4_i8_h2(va[u].x" in plain
    wide = qfloor.variant_source(warps=16)
    assert "#define Q_WARPS 16 " in wide and "__launch_bounds__(32 * Q_WARPS, 1)" in wide


def test_a_kernel_that_changed_is_named_not_silently_measured():
    with pytest.raises(ValueError, match="no longer has exactly one"):
        qfloor._replace_once("no such line", qfloor.STAGE, "")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("label", ["neither", "16 warps"])
def test_variant_compiles_with_nvcc_for_sm90(label, tmp_path):
    source = tmp_path / "variant.cu"
    source.write_text(qfloor.variant_source(**qfloor.VARIANTS[label]))
    result = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-c", str(source), "-o", str(tmp_path / "v.o")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
