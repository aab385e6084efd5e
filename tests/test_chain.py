"""The decode step's launch tunings and minillm.cuda.dev.chain's "leave a kind out", on the CPU: the engine's own
decode step records its launches (minillm.course.recording_model) instead of making them."""
import numpy as np
import pytest

from minillm.course.gpu_parts import recording_model
from minillm.cuda.dev.chain import LEFT_OUT, kind_of, leaving_out
from minillm.cuda.dev.lab import LabKernels, lab_settings
from minillm.cuda.kernels import Kernels, KernelSettings
from minillm.model.config import PRESETS

MISTRAL = PRESETS["mistral-7b"].config


def decode_launches(settings=None, model=None):
    """[(kernel, label, args)] of one decode step of a recording Mistral-7B (or `model`, made by it)."""
    m, cache, _ = recording_model(MISTRAL, settings=settings) if model is None else model
    calls = []
    m.k._launch = lambda name, grid, block, args, label="", shared_mem=0: calls.append((name, label, args))
    m.decode_step(cache)
    return calls


def quant_launcher(settings: KernelSettings, calls: list, kind=Kernels):
    """A Kernels (or LabKernels) made without CuPy (an H200's 132 SMs) whose launches append (name, grid, label,
    args) to calls."""
    k = object.__new__(kind)
    k.settings = settings
    k.n_sms, k.max_quant_smem = 132, 227 * 1024
    k._nil_f32 = k._nil_u16 = k._nil_i32 = object()
    k._launch = lambda name, grid, block, args, label="", shared_mem=0: calls.append((name, grid, label, args))
    return k


def quant_matrix(method: str, rows: int, n_in: int):
    """A QuantMatrix of that shape (host arrays: only its layout is read by the launcher)."""
    from minillm.cuda.qweights import QuantMatrix
    from test_qtma_plan import random_layout
    q, s, mins = random_layout(method, 2, n_in, 128, np.random.default_rng(0))
    return QuantMatrix(method, np.zeros((rows, q.shape[1]), q.dtype), s, mins, n_in, 128)


@pytest.mark.parametrize("lab", [False, True])
def test_the_int8_qkv_gemv_runs_its_3_blocks_an_sm_build_in_one_round(lab):
    """Mistral-7B's int8 q|k|v GEMV launches gemv_quant.cu's _3b kernel over 384 blocks (3072 row pairs, 8 a
    block, one round), where the 2-blocks-an-SM build (the lab's qkv_one_round=False) takes 192 blocks of two
    rounds; int4's q|k|v and every other GEMV keep the 2-block build."""
    calls = []
    k = quant_launcher(lab_settings(qkv_one_round=False), calls, LabKernels) if lab else quant_launcher(
        KernelSettings(), calls)
    qkv = (None, None, None, None, 32, 8, 128)                         # no cache: RoPE only
    for method in ("int8", "int4"):
        k._quant("gemv_qkv_v4", quant_matrix(method, 6144, 4096), None, "gain", 1e-5, None, 3072, label="qkv",
                 qkv=qkv)
        k._quant("gemv_v4", quant_matrix(method, 4096, 4096), None, None, 0.0, None, 2048, True, "o")
    got = [(name, grid[0]) for name, grid, _, _ in calls]
    first = ("gemv_rmsnorm_qkv_int8", 192) if lab else ("gemv_rmsnorm_qkv_int8_3b", 384)
    assert got == [first, ("gemv_int8", 256), ("gemv_rmsnorm_qkv_int4", 192), ("gemv_int4", 256)]


@pytest.mark.parametrize("split_keys", [0, 256])
def test_the_attention_split_setting_reaches_the_group_kernel(split_keys):
    """attention_gqa*'s arguments: the 11 shared ones, split_keys, max_splits (one wave: 132 SMs // 8 blocks),
    then the scratch."""
    calls = decode_launches(KernelSettings(attention_split_keys=split_keys))
    attention = [args for name, _, args in calls if name == "attention_gqa4"]
    assert len(attention) == MISTRAL.n_layers
    assert {(int(args[11]), int(args[12])) for args in attention} == {(split_keys, 16)}


@pytest.mark.parametrize("left_out", list(LEFT_OUT))
def test_leaving_a_kind_out_removes_its_launches_and_only_them(left_out):
    m, cache, full = recording_model(MISTRAL)          # records "kernel label" through the Kernels' timer
    m.decode_step(cache)
    m2, cache2, recorded = recording_model(MISTRAL)
    leaving_out(m2, LEFT_OUT[left_out]).decode_step(cache2)
    kept = [s for s in full if kind_of(*s.partition(" ")[::2]) not in LEFT_OUT[left_out]]
    assert recorded == kept and len(kept) < len(full)
    m2.decode_step(cache2)                             # the original still launches everything
    assert recorded[len(kept):] == full
