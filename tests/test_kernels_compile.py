"""Every kernels/*.cu compiles: with nvcc as a standalone file, for Hopper (sm_90) and for the GPUs before it
(sm_80: the shipped path runs there without PDL), and, where CuPy's NVRTC binding loads, exactly as
minillm.cuda.kernels hands it to NVRTC at run time. The lab's kernels (minillm/cuda/dev/kernels, which include
the shipped headers) compile for sm_90. No GPU needed."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from minillm.cuda import gpu_mla
from minillm.cuda.dev import flashnorm, lab, qmma, qtma, small_m
from minillm.cuda.kernels import KERNEL_DIR, SOURCES, kernel_source, kernel_table

CU_FILES = sorted(KERNEL_DIR.glob("*.cu"))
LAB_CU_FILES = sorted(lab.LAB_KERNEL_DIR.glob("*.cu"))
# Sources other modules load themselves (through kernels.module), beside kernels.py's own list.
OTHER_SOURCES = {gpu_mla.SOURCE: gpu_mla.KERNELS}
# The lab's sources: name -> {key: kernel name with {sfx}}
LAB_SOURCES = {flashnorm.SOURCE: flashnorm.KERNELS, small_m.SOURCE: small_m.KERNELS, qmma.SOURCE: qmma.KERNELS,
               qtma.SOURCE: qtma.KERNELS, "attention_v1": lab.ATTENTION_V1} | {
    source: {name: f"{name}_{{sfx}}" for name in names} for source, names in lab.LAB_KERNELS.items()}


def test_every_source_is_listed():
    assert sorted(p.stem for p in CU_FILES) == sorted(SOURCES + list(OTHER_SOURCES))
    assert sorted(p.stem for p in LAB_CU_FILES) == sorted(LAB_SOURCES)


def _nvcc(path: Path, arch: str, out: Path, *extra: str):
    return subprocess.run(["nvcc", f"-arch={arch}", "-std=c++17", "-Werror", "all-warnings", *extra, "-c", str(path),
                           "-o", str(out)], capture_output=True, text=True)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
@pytest.mark.parametrize("path", CU_FILES, ids=lambda p: p.name)
def test_the_shipped_kernels_compile_with_nvcc(path: Path, arch: str, tmp_path: Path):
    result = _nvcc(path, arch, tmp_path / "k.o")
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("path", LAB_CU_FILES, ids=lambda p: p.name)
def test_the_labs_kernels_compile_with_nvcc_for_sm90(path: Path, tmp_path: Path):
    result = _nvcc(path, "sm_90", tmp_path / "k.o", f"-I{KERNEL_DIR}")
    assert result.returncode == 0, result.stderr


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()
        return nvrtc
    except Exception:
        return None


@pytest.mark.skipif(_nvrtc() is None, reason="CuPy's NVRTC binding is not available")
@pytest.mark.parametrize("name", SOURCES + list(OTHER_SOURCES) + list(LAB_SOURCES))
def test_compiles_with_nvrtc_for_compute90(name: str):
    nvrtc = _nvrtc()
    text = kernel_source(name) if name in SOURCES or name in OTHER_SOURCES else lab.lab_source(name)
    prog = nvrtc.createProgram(text, f"{name}.cu", [], [])
    try:
        nvrtc.compileProgram(prog, ["--gpu-architecture=compute_90", "--std=c++17"])
    except Exception:
        pytest.fail(nvrtc.getProgramLog(prog))
    finally:
        nvrtc.destroyProgram(prog)


def _defined(path: Path) -> set[str]:
    """The extern "C" kernels of a source, with the files it includes (kernels stamped by a macro too)."""
    text = kernel_source(path.stem, path.parent)
    defined = set(re.findall(r'extern "C" __global__ void (\w+)\(', text))
    defined |= set(re.findall(r'extern "C" __global__ void __launch_bounds__\([^)]*\) (\w+)\(', text))
    return defined | set(re.findall(r'^[A-Z0-9_]+_KERNEL(?:_AT)?\((\w+),', text, re.M))   # macro-stamped kernels


def test_every_launched_kernel_is_defined():
    """The names minillm.cuda.kernels and the lab fetch exist as extern "C" kernels of the file they are
    fetched from (a typo would otherwise surface only on a GPU machine)."""
    defined = set().union(*(_defined(p) for p in CU_FILES))
    for sfx in ("f16", "bf16"):
        table = kernel_table(sfx)
        for source, name in table.values():
            assert name in _defined(KERNEL_DIR / f"{source}.cu"), (source, name)
        assert {"gemv_qkv_int8_3b", "attention_gqa4_int8x16", "prefill_attention_mma_hd128"} <= set(table)
        for names in OTHER_SOURCES.values():
            wanted = {n.format(sfx=sfx) for n in names.values()}
            assert wanted <= defined, wanted - defined
        for source, names in LAB_SOURCES.items():
            wanted = {n.format(sfx=sfx) for n in names.values()}
            have = _defined(lab.LAB_KERNEL_DIR / f"{source}.cu")
            assert wanted <= have, (source, wanted - have)


def _defines(source: str, folder: Path = KERNEL_DIR) -> dict[str, int]:
    """FOLDER/SOURCE.cu's plain integer #defines (the first of each: an #ifndef default counts)."""
    out = {}
    for name, value in re.findall(r"^#define (\w+) (\d+)\b", (folder / f"{source}.cu").read_text(), re.M):
        out.setdefault(name, int(value))
    return out


def test_the_launchers_sizes_are_the_kernels_own():
    """A block size, a warp count or a bound the launchers repeat ("as #defined in ...") equals the kernel's:
    a kernel changed alone would otherwise be launched with the old grid (wrong rows, or out of bounds)."""
    from minillm.cuda import forward, gpu_mla, kernels as k
    same = [("decode_attention", "ATTN_WARPS", k.ATTN_WARPS), ("decode_attention", "MAX_HD", k.MAX_HD),
            ("decode_attention", "GQA_THREADS", k.GQA_THREADS), ("decode_attention", "GQA_MAX_SPLITS", k.GQA_MAX_SPLITS),
            ("gemv", "V4_WARPS", k.V4_WARPS), ("prefill_attention", "PF_ROWS", k.PF_ROWS),
            ("prefill_attention_mma", "MM_WARPS", k.MM_THREADS // 32),
            ("gemv_quant", "Q_WARPS", k.QWARPS), ("gemv_quant", "Q_MIN_BLOCKS", k.QUANT_BLOCKS_PER_SM),
            ("gemv_quant", "Q_QKV_MIN_BLOCKS", k.QKV_BLOCKS_PER_SM),
            ("paged_attention", "PA_WARPS", forward.PA_WARPS), ("paged_attention", "PA_MAX_HD", forward.PA_MAX_HD),
            ("mla_decode", "MLA_TK", gpu_mla.MLA_TK), ("mla_decode", "MLA_HEADS", gpu_mla.MLA_HEADS),
            ("mla_decode", "MLA_MAX_W", gpu_mla.MLA_MAX_W), ("mla_decode", "MLA_MAX_R", gpu_mla.MLA_MAX_R),
            ("mla_decode", "MLA_ABSORB_COLS", gpu_mla.MLA_ABSORB_COLS)]
    in_the_lab = [("gemv_quant_mma", "M_WARPS", lab.MMA_WARPS), ("gemv_quant_tma", "T_WARPS", lab.TMA_THREADS // 32 - 1),
                  ("gemv_quant_tma", "T_MAX_STAGES", lab.TMA_MAX_STAGES),
                  ("gemv_quant_tma", "T_MAX_PAIRS", lab.TMA_MAX_PAIRS)]
    for checks, folder in ((same, KERNEL_DIR), (in_the_lab, lab.LAB_KERNEL_DIR)):
        defines = {source: _defines(source, folder) for source, _, _ in checks}     # each file read once
        for source, name, python in checks:
            kernel = defines[source].get(name)
            assert kernel == python, f"{source}.cu {name} = {kernel}, the launcher: {python}"
    assert k.MM_ROWS == 16 * k.MM_THREADS // 32                  # prefill_attention_mma.cu: 16 rows a warp
