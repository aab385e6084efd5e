"""dev.layer's one-kernel-a-layer experiment on the CPU: the layer kernel compiles as dev.layer compiles it
(nvcc, sm_90) with every phase inside the registers two blocks an SM allow; each GEMV's launch arguments
become the kernel's 64-bit words in _quant_args' order; a recorded step becomes embed, a layer kernel a layer,
the head. Whether its logits equal the engine's, bit for bit, is dev.layer's check on the GPU."""
from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest

from minillm.cuda.dev.layer import DEFINES, PHASES, WORDS, layer_source, phase_words, plan_step
from minillm.cuda.kernels import Kernels, KernelSettings


class Device:
    """A stand-in device array: only its address matters here."""
    def __init__(self, ptr: int):
        self.data = type("Memory", (), {"ptr": ptr})()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_the_layer_kernels_compile_within_two_blocks_an_sm(tmp_path):
    (tmp_path / "layer.cu").write_text(layer_source())
    result = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-Werror", "all-warnings", *DEFINES, "-cubin",
                             "-Xptxas", "-v", str(tmp_path / "layer.cu"), "-o", str(tmp_path / "k.cubin")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    used = dict(re.findall(r"Function properties for (gemv_layer_int[48])\n.*?\n.*?Used (\d+) registers",
                           result.stderr, re.S))
    assert set(used) == {"gemv_layer_int8", "gemv_layer_int4"}
    assert all(int(n) <= 128 for n in used.values())          # 2 blocks of 256 threads: 65536 registers


def test_a_gemvs_arguments_become_the_kernels_words():
    """The words are _quant_args' first 24 as the kernel reads them: addresses, integers, eps's float bits."""
    k = object.__new__(Kernels)
    k.settings = KernelSettings(quant_flags=1)
    k._nil_f32, k._nil_u16, k._nil_i32 = Device(16), Device(32), Device(48)
    args = k._quant_args(Device(0x1000), Device(0x2000), Device(0x3000), 256, 32, 4, Device(0x4000), Device(0x5000),
                         1e-5, 4096, 2048, Device(0x6000), 4096, True, None, 1, None)
    words = phase_words(("gemv_int8", (264,), (256,), args, "o", 0))
    assert len(words) == WORDS
    assert words[:3] == [0x1000, 0x2000, 0x3000] and words[3:7] == [256, 32, 4, 2]      # cpg 4: its log2, 2
    assert words[7:9] == [0x4000, 0x5000] and np.uint32(words[9]).view(np.float32) == np.float32(1e-5)
    assert words[10:15] == [4096, 2048, 0x6000, 4096, 1]
    assert words[15:17] == [32, 32] and words[23] == 1                    # no KV append: stand-ins; flags


def _launch(label, smem=0, args=tuple(range(WORDS + 5))):
    return (f"gemv {label}", (264,), (256,), args, label, smem)


def test_a_step_becomes_embed_a_layer_kernel_a_layer_and_the_head():
    layer = [_launch(p, 1000 * (i + 1)) for i, p in enumerate(PHASES)]
    step = plan_step([("embed", (1,), (128,), (), "", 0)] + layer + layer + [_launch("lm_head")])
    assert [s[0] for s in step] == ["embed", "layer", "layer", "gemv lm_head"]
    assert step[1][1] == sum((phase_words(g) for g in layer), []) and len(step[1][1]) == WORDS * 4
    assert step[1][2] == 4000                                                 # the widest phase's shared memory


def test_a_step_out_of_the_phases_order_is_refused():
    with pytest.raises(ValueError, match="expected"):
        plan_step([_launch(p) for p in ("qkv", "gate_up", "o", "down")])
    with pytest.raises(ValueError, match="outside"):
        plan_step([_launch("o")])
