"""The quantized GEMV v3's data flow (kernels/gemv_quant_mma.cu), emulated in NumPy (minillm.cuda.dev.qmma):
the k permutation, the mma.m16n8k16 fragment placement, the codes' bit tricks and offsets, int4's group fold
and the row pairs must give W·x exactly (fp64) for the x the kernel multiplies. Catches layout bugs without
a GPU; the GPU check of the kernel itself is `python -m minillm.cuda.dev.qmma`."""
from __future__ import annotations

import numpy as np
import pytest

from minillm.cuda.dev.common import QUANT_TOL
from minillm.cuda.dev.qmma import dequantized, emulate, random_layout, x_used, stage


SHAPES = [(1, 16), (13, 201), (16, 128), (37, 520), (64, 1000), (3, 2048), (130, 384)]


@pytest.mark.parametrize("method,group", [("int8", 0), ("int4", 128), ("int4", 256)])
@pytest.mark.parametrize("rows,n_in", SHAPES)
@pytest.mark.parametrize("U", [2, 4])
def test_emulation_reproduces_w_times_x_exactly(method, group, rows, n_in, U):
    rng = np.random.default_rng(rows * 1000 + n_in)
    q, s, m = random_layout(method, rows, n_in, group or 128, rng)
    x = (rng.standard_normal(n_in) * rng.uniform(0.01, 100)).astype(np.float32)
    y, xh = emulate(method, q, s, m, group or 128, x, U=U)
    want = dequantized(method, q, s, m, group or 128, n_in) @ xh
    assert np.abs(y - want).max() <= 1e-12 * np.abs(want).max()


@pytest.mark.parametrize("method,group", [("int8", 0), ("int4", 128)])
def test_emulation_with_fp32_sums_stays_within_the_quantized_tolerance(method, group):
    """The kernel's roundings (x to fp16, fp32 sums and offsets) against exact x: the error budget."""
    rng = np.random.default_rng(5)
    rows, n_in = 48, 4096
    q, s, m = random_layout(method, rows, n_in, group or 128, rng)
    x = (rng.standard_normal(n_in) * 3 + 0.5).astype(np.float32)      # a mean: the offsets' worst case
    x[7] = 300.0                                                       # and an outlier
    y, _ = emulate(method, q, s, m, group or 128, x, exact=False)
    want = dequantized(method, q, s, m, group or 128, n_in) @ x.astype(np.float64)
    assert np.abs(y - want).max() <= QUANT_TOL / 3 * np.abs(want).max()


def test_staged_x_is_what_the_kernel_multiplies():
    """x_used undoes the staging's order and scale: fp16 rounding is all that is left."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(300) * 1e3).astype(np.float32)
    for int4 in (False, True):
        st = stage(x, None, 24, int4, exact=True)            # 24 chunks: >= 300 values
        xh = x_used(st, 300, int4)
        assert np.abs(xh - x).max() <= 2 ** -11 * np.abs(x).max()
        assert 2 ** 14 <= np.abs(x).max() / st["down"] < 2 ** 15


def test_int4_groups_of_32_are_refused():
    rng = np.random.default_rng(0)
    q, s, m = random_layout("int4", 4, 64, 32, rng)
    with pytest.raises(ValueError, match="multiple of 128"):
        emulate("int4", q, s, m, 32, np.ones(64, np.float32))


def _launches(method: str, group: int, n_in: int, version: int, name: str = "gemv_v4", **settings) -> list:
    """What LabKernels._quant launches for a quantized matrix (no GPU: the launch is recorded, not run)."""
    from minillm.cuda.dev.lab import LabKernels, lab_settings
    from minillm.cuda.qweights import QuantMatrix
    k = object.__new__(LabKernels)                    # no __init__: nothing is compiled or loaded
    k.settings = lab_settings(quant_version=version, **settings)
    k.n_sms, k.max_quant_smem = 132, 227 * 1024
    k._nil_f32 = k._nil_u16 = k._nil_i32 = object()
    calls = []
    k._launch = lambda name, grid, block, args, label="", shared_mem=0: calls.append((name, grid, block, shared_mem))
    q, s, m = random_layout(method, 2, n_in, group or 128, np.random.default_rng(0))
    rows = 4096
    w = QuantMatrix(method, np.zeros((rows, q.shape[1]), q.dtype), s, m, n_in, group)
    k._quant(name, w, None, None, 0.0, None, rows // 2)
    return calls


def test_quant_version_3_launches_the_mma_kernels():
    """int8 and int4 in groups of 128: v3's kernel, grid (tiles of 8 pairs, ~3 blocks an SM), shared memory
    (x in 32 bytes a chunk + 4 a step of 8 chunks, or 82 a chunk; chunks rounded up to 8); int4 in groups of
    32: v2's."""
    (name, grid, block, smem), = _launches("int8", 0, 4096, 3)
    assert (name, grid, block, smem) == ("gemv_int8_v3", (256,), (256,), 256 * 32 + 32 * 4)
    (name, grid, _, smem), = _launches("int4", 128, 14336, 3, "gemv_swiglu_v4")
    assert (name, grid, smem) == ("gemv_swiglu_int4_v3", (256,), 448 * 82)
    (name, _, _, _), = _launches("int4", 32, 4096, 3)
    assert name == "gemv_int4"
    (name, _, _, _), = _launches("int8", 0, 4096, 2)
    assert name == "gemv_int8"
    (name, _, _, smem), = _launches("int4", 128, 4200, 3, quant_mma_substeps=4)       # 132 chunks -> 144
    assert (name, smem) == ("gemv_int4_v3u4", 144 * 82)
    with pytest.raises(ValueError, match="plain"):
        _launches("int8", 0, 4096, 3, "gemv_swiglu_v4", quant_mma_substeps=4)


def test_the_launcher_and_the_dev_module_name_the_same_kernels():
    from minillm.cuda.dev.qmma import KERNELS
    from minillm.cuda.dev.lab import VARIANTS
    assert ({f"gemv_{e}{m}_v3_{{sfx}}" for m in ("int8", "int4") for e in VARIANTS}
            | {f"gemv_{m}_v3u4_{{sfx}}" for m in ("int8", "int4")} == set(KERNELS.values()))
