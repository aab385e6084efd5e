"""Every kernels/*.cu compiles for Hopper: with nvcc (sm_90, as a standalone file) and, where CuPy's
NVRTC binding loads, exactly as minillm.cuda.kernels hands it to NVRTC at run time. No GPU needed."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from minillm.cuda import gpu_mla
from minillm.cuda.dev import flashnorm, qmma, qtma, small_m
from minillm.cuda.kernels import KERNEL_DIR, SOURCES, kernel_source

CU_FILES = sorted(KERNEL_DIR.glob("*.cu"))
# Sources other modules load themselves (through kernels.module), beside kernels.py's own list.
OTHER_SOURCES = {flashnorm.SOURCE: flashnorm.KERNELS, small_m.SOURCE: small_m.KERNELS, gpu_mla.SOURCE: gpu_mla.KERNELS,
                 qmma.SOURCE: qmma.KERNELS, qtma.SOURCE: qtma.KERNELS}


def test_every_source_is_listed():
    assert sorted(p.stem for p in CU_FILES) == sorted(SOURCES + list(OTHER_SOURCES))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("path", CU_FILES, ids=lambda p: p.name)
def test_compiles_with_nvcc_for_sm90(path: Path, tmp_path: Path):
    result = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-Werror", "all-warnings", "-c", str(path),
                             "-o", str(tmp_path / "k.o")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()
        return nvrtc
    except Exception:
        return None


@pytest.mark.skipif(_nvrtc() is None, reason="CuPy's NVRTC binding is not available")
@pytest.mark.parametrize("name", SOURCES + list(OTHER_SOURCES))
def test_compiles_with_nvrtc_for_compute90(name: str):
    nvrtc = _nvrtc()
    prog = nvrtc.createProgram(kernel_source(name), f"{name}.cu", [], [])
    try:
        nvrtc.compileProgram(prog, ["--gpu-architecture=compute_90", "--std=c++17"])
    except Exception:
        pytest.fail(nvrtc.getProgramLog(prog))
    finally:
        nvrtc.destroyProgram(prog)


def test_every_launched_kernel_is_defined():
    """The names minillm.cuda.kernels fetches exist as extern "C" kernels (a typo would otherwise
    surface only on a GPU machine)."""
    defined = set()
    for path in CU_FILES:
        text = path.read_text()
        defined |= set(re.findall(r'extern "C" __global__ void (\w+)\(', text))
        defined |= set(re.findall(r'^[A-Z0-9_]+_KERNEL(?:_AT)?\((\w+),', text, re.M))   # macro-stamped kernels
    launcher = (Path(__file__).parents[1] / "minillm" / "cuda" / "kernels.py").read_text()
    for sfx in ("f16", "bf16"):
        wanted = {n.replace("{sfx}", sfx) for n in re.findall(r'get\("\w+", f?"([\w{}]+)"\)', launcher)}
        assert wanted and wanted <= defined, wanted - defined
        for names in OTHER_SOURCES.values():
            wanted = {n.format(sfx=sfx) for n in names.values()}
            assert wanted <= defined, wanted - defined


def _defines(source: str) -> dict[str, int]:
    """kernels/SOURCE.cu's plain integer #defines (the first of each: an #ifndef default counts)."""
    out = {}
    for name, value in re.findall(r"^#define (\w+) (\d+)\b", (KERNEL_DIR / f"{source}.cu").read_text(), re.M):
        out.setdefault(name, int(value))
    return out


def test_the_launchers_sizes_are_the_kernels_own():
    """A block size, a warp count or a bound the launchers repeat ("as #defined in ...") equals the kernel's:
    a kernel changed alone would otherwise be launched with the old grid (wrong rows, or out of bounds)."""
    from minillm.cuda import gpu_batched, gpu_mla, kernels as k
    same = [("decode_attention", "ATTN_WARPS", k.ATTN_WARPS), ("decode_attention", "MAX_HD", k.MAX_HD),
            ("decode_attention", "GQA_THREADS", k.GQA_THREADS), ("decode_attention", "GQA_MAX_SPLITS", k.GQA_MAX_SPLITS),
            ("gemv", "V4_WARPS", k.V4_WARPS), ("prefill_attention", "PF_ROWS", k.PF_ROWS),
            ("prefill_attention_mma", "MM_WARPS", k.MM_THREADS // 32),
            ("gemv_quant", "Q_WARPS", k.QWARPS), ("gemv_quant", "Q_MIN_BLOCKS", k.QUANT_BLOCKS_PER_SM),
            ("gemv_quant", "Q_QKV_MIN_BLOCKS", k.QKV_BLOCKS_PER_SM), ("gemv", "V4_QKV_BLOCKS", k.V4_QKV_BLOCKS),
            ("gemv_quant_mma", "M_WARPS", k.MMA_WARPS), ("gemv_quant_tma", "T_WARPS", k.TMA_THREADS // 32 - 1),
            ("gemv_quant_tma", "T_MAX_STAGES", k.TMA_MAX_STAGES), ("gemv_quant_tma", "T_MAX_PAIRS", k.TMA_MAX_PAIRS),
            ("paged_attention", "PA_WARPS", gpu_batched.PA_WARPS), ("paged_attention", "PA_MAX_HD", gpu_batched.PA_MAX_HD),
            ("mla_decode", "MLA_TK", gpu_mla.MLA_TK), ("mla_decode", "MLA_HEADS", gpu_mla.MLA_HEADS),
            ("mla_decode", "MLA_MAX_W", gpu_mla.MLA_MAX_W), ("mla_decode", "MLA_MAX_R", gpu_mla.MLA_MAX_R),
            ("mla_decode", "MLA_ABSORB_COLS", gpu_mla.MLA_ABSORB_COLS)]
    defines = {source: _defines(source) for source, _, _ in same}                  # each file read once
    for source, name, python in same:
        kernel = defines[source].get(name)
        assert kernel == python, f"{source}.cu {name} = {kernel}, the launcher: {python}"
    assert k.MM_ROWS == 16 * k.MM_THREADS // 32                  # prefill_attention_mma.cu: 16 rows a warp
