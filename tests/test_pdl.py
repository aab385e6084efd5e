"""Programmatic dependent launch (minillm/cuda/pdl.py, KernelSettings.pdl), on the CPU: the ctypes structs
match cuda.h, arguments convert to the C types the kernels take, only kernels that wait for the kernel
ahead get the attribute, and the decode step launches every one of its kernels that way. That PDL changes
no number is checked on the GPU (tests/test_cuda_pdl.py)."""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from minillm.course import record_decode_launches
from minillm.course.gpu_parts import recording_model
from minillm.cuda import pdl
from minillm.cuda.dev.lab import lab_settings
from minillm.cuda.kernels import KERNEL_DIR, PDL_KERNEL, KernelSettings
from minillm.model.config import PRESETS

MISTRAL = PRESETS["mistral-7b"].config
CUDA_H = next((p for p in sorted(Path("/usr/local").glob("cuda*/include/cuda.h"))), None)


def test_structs_have_cuda_h_layout():
    assert ctypes.sizeof(pdl.LaunchAttribute) == 72                          # 8 (id + pad) + 64 (the union)
    assert pdl.LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(pdl.LaunchConfig) == 56
    assert (pdl.LaunchConfig.shared_mem.offset, pdl.LaunchConfig.stream.offset, pdl.LaunchConfig.attrs.offset,
            pdl.LaunchConfig.n_attrs.offset) == (24, 32, 40, 48)


@pytest.mark.skipif(CUDA_H is None or shutil.which("gcc") is None, reason="no cuda.h or no C compiler here")
def test_structs_match_the_installed_cuda_h(tmp_path):
    """The same sizes and offsets as the C compiler computes from the toolkit's own header."""
    src = tmp_path / "layout.c"
    src.write_text("#include <cuda.h>\n#include <stddef.h>\n#include <stdio.h>\nint main(void) {\n"
                   "  printf(\"%zu %zu %zu %zu %zu %zu %zu %d\\n\", sizeof(CUlaunchAttribute),\n"
                   "         offsetof(CUlaunchAttribute, value), sizeof(CUlaunchConfig),\n"
                   "         offsetof(CUlaunchConfig, sharedMemBytes), offsetof(CUlaunchConfig, hStream),\n"
                   "         offsetof(CUlaunchConfig, attrs), offsetof(CUlaunchConfig, numAttrs),\n"
                   "         (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);\n  return 0;\n}\n")
    exe = tmp_path / "layout"
    subprocess.run(["gcc", f"-I{CUDA_H.parent}", str(src), "-o", str(exe)], check=True)
    got = [int(v) for v in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()]
    C = pdl.LaunchConfig
    assert got == [ctypes.sizeof(pdl.LaunchAttribute), pdl.LaunchAttribute.value.offset, ctypes.sizeof(C),
                   C.shared_mem.offset, C.stream.offset, C.attrs.offset, C.n_attrs.offset,
                   pdl.PROGRAMMATIC_STREAM_SERIALIZATION]


def test_launch_config_carries_dims_and_the_attribute():
    attribute = pdl.LaunchAttribute(pdl.PROGRAMMATIC_STREAM_SERIALIZATION, b"", 1)
    config = pdl.launch_config((7, 3), 256, 4096, 0x1234, attribute)
    assert list(config.grid) == [7, 3, 1] and list(config.block) == [256, 1, 1]
    assert (config.shared_mem, config.stream, config.n_attrs) == (4096, 0x1234, 1)
    assert config.attrs.contents.id == 6 and config.attrs.contents.value == 1


class FakeDeviceArray:
    class data:
        ptr = 0xdead0000


def test_arguments_become_the_c_types_of_the_kernel_parameters():
    assert pdl.kernel_argument(FakeDeviceArray()).value == 0xdead0000
    assert isinstance(pdl.kernel_argument(np.int32(-3)), ctypes.c_int32) and pdl.kernel_argument(np.int32(-3)).value == -3
    assert pdl.kernel_argument(np.float32(0.5)).value == 0.5
    assert pdl.kernel_argument(np.uint64(2**40)).value == 2**40
    with pytest.raises(TypeError, match="np.int32"):
        pdl.kernel_argument(3)                          # a bare Python int has no C type: refused, not guessed


def defined_kernels(folder=KERNEL_DIR) -> dict[str, str]:
    """extern "C" kernel name -> the source text of its file (kernels/, or the lab's folder)."""
    names = {}
    for path in folder.glob("*.cu"):
        text = path.read_text()
        for name in re.findall(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\(', text):
            names[name] = text
        for name in re.findall(r"^(?:GEMV_V4|GEMV_QUANT(?:_TMA)?|GEMV_MMA|ATTENTION_GQA(?:_INT8)?)_KERNEL(?:_AT)?\((\w+),",
                               text, re.M):
            names[name] = text
    return names


def test_every_pdl_kernel_waits_for_the_kernel_ahead():
    """A kernel given the attribute without calling pdl_wait would read its inputs while they are written."""
    kernels = defined_kernels()
    pdl_ones = {n for n in kernels if PDL_KERNEL.fullmatch(re.sub(r"_(f16|bf16)$", "", n))}
    assert len(pdl_ones) == 50                           # embed, the GEMVs (v4, int8, int4), attention v3, both dtypes
    for name in pdl_ones:
        assert "pdl_wait_then_trigger();" in kernels[name], name
    assert not PDL_KERNEL.fullmatch("kv_append_int8") and not PDL_KERNEL.fullmatch("attention_fused")


def test_every_pdl_kernel_of_the_lab_waits_for_the_kernel_ahead():
    """The same for minillm/cuda/dev/kernels (the quantized GEMV v1, v3, v4, the 16-bit TMA GEMV); the first
    16-bit GEMVs (gemv_versions.cu) do not wait and are launched plainly."""
    from minillm.cuda.dev.lab import LAB_KERNEL_DIR, LabKernels
    kernels = defined_kernels(LAB_KERNEL_DIR)
    lab = LabKernels.__new__(LabKernels)
    lab.settings, lab.arch = lab_settings(), 90
    pdl_ones = {n for n in kernels if lab.uses_pdl(re.sub(r"_(f16|bf16)$", "", n))}
    assert len(pdl_ones) == 72                           # v1 4, the 2-block q|k|v 4, v3 28, v4 24, 16-bit TMA 12
    for name in pdl_ones:
        assert "pdl_wait_then_trigger();" in kernels[name] or '#include "gemv_quant.cu"' in kernels[name], name
    assert not lab.uses_pdl("gemv_v2") and not lab.uses_pdl("gemv_rmsnorm_v3")


@pytest.mark.parametrize("arch,pdl", [(90, True), (89, False), (80, False)])
def test_pdl_only_on_hopper(arch, pdl):
    """On sm_80 / sm_89 (no griddepcontrol) the shipped kernels launch plainly, whatever the settings say."""
    from minillm.cuda.kernels import Kernels
    k = Kernels.__new__(Kernels)
    k.settings, k.arch = KernelSettings(pdl=True), arch
    assert k.uses_pdl("gemv_v4") is pdl and k.uses_pdl("attention_gqa4") is pdl


@pytest.mark.parametrize("kv_cache,plain", [("auto", set()), ("int8", {"kv_append_int8"})])
def test_with_pdl_the_decode_step_launches_its_kernels_with_it(kv_cache, plain):
    """Every launch of the step (captured into its graph) carries the attribute except kernels without the
    wait, launched plainly."""
    settings = KernelSettings(pdl=True)
    launches = record_decode_launches(MISTRAL, kv_cache=kv_cache, settings=settings)
    model, _, _ = recording_model(MISTRAL, settings=settings)
    names = {entry.split()[0] for entry in launches}
    assert {n for n in names if not model.k.uses_pdl(n)} == plain
    assert not any(model.k.with_settings(pdl=False).uses_pdl(n) for n in names)     # and none without it


def test_a_gpu_before_sm_80_is_refused_in_one_line(monkeypatch):
    """A Turing card (sm_75) has no bf16 mma.sync for the tensor-core prefill: Kernels says so in one line,
    naming the architecture, before it compiles anything."""
    import sys
    from types import SimpleNamespace

    from minillm.cuda.kernels import Kernels
    from minillm.errors import MiniLLMError
    runtime = SimpleNamespace(getDeviceProperties=lambda i: {"major": 7, "minor": 5, "multiProcessorCount": 40})
    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(cuda=SimpleNamespace(
        runtime=runtime, Device=lambda: SimpleNamespace(id=0))))
    with pytest.raises(MiniLLMError, match="sm_75") as refused:
        Kernels("float16")
    assert "\n" not in str(refused.value) and "sm_80" in str(refused.value)
