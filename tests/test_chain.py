"""The prefetches across the decode chain's links and minillm.cuda.dev.chain's "leave a kind out", on the CPU:
the engine's own decode step records its launches (minillm.course.recording_model) instead of making them.
What the prefetches do to the numbers (nothing, bit for bit) is checked on the GPU (tests/test_cuda_pdl.py)."""
import numpy as np
import pytest

from minillm.course.gpu_parts import recording_model
from minillm.cuda.dev.chain import LEFT_OUT, kind_of, leaving_out
from minillm.cuda.kernels import GQA_PREFETCH_KV, PREWAIT_ROWS, KernelSettings
from minillm.model.config import PRESETS

MISTRAL = PRESETS["mistral-7b"].config


def decode_launches(settings=None, model=None):
    """[(kernel, label, args)] of one decode step of a recording Mistral-7B (or `model`, made by it)."""
    m, cache, _ = recording_model(MISTRAL, settings=settings) if model is None else model
    calls = []
    m.k._launch = lambda name, grid, block, args, label="", shared_mem=0: calls.append((name, label, args))
    m.decode_step(cache)
    return calls


def test_only_the_named_gemvs_ask_for_their_whole_rows_before_the_wait():
    """gemv.cu v4's last argument is its flags: PREWAIT_ROWS on every o_proj, nowhere else, and on nothing
    by default."""
    calls = decode_launches(KernelSettings(prefetch_rows_before_wait=("o",)))
    gemvs = [(label, int(args[-1])) for name, label, args in calls if name.startswith("gemv_")]
    assert len(gemvs) == 4 * MISTRAL.n_layers + 1
    assert {label: flags for label, flags in gemvs} == {"qkv": 0, "o": PREWAIT_ROWS, "gate_up": 0, "down": 0,
                                                         "lm_head": 0}
    assert {int(args[-1]) for name, _, args in decode_launches() if name.startswith("gemv_")} == {0}


def quant_launcher(settings: KernelSettings, calls: list):
    """A Kernels made without CuPy (an H200's 132 SMs) whose launches append (name, grid, label, args) to calls."""
    from minillm.cuda.kernels import Kernels
    k = object.__new__(Kernels)
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


def test_the_quantized_gemv_gets_the_bit_beside_its_own_flags():
    """gemv_quant.cu's flags (argument 23) carry Q_LOOKAHEAD and PREWAIT_ROWS together."""
    calls = []
    k = quant_launcher(KernelSettings(quant_flags=1, prefetch_rows_before_wait=("o",)), calls)
    for label in ("o", "down"):
        k._quant("gemv_v4", quant_matrix("int8", 4096, 4096), None, None, 0.0, None, 2048, True, label)
    assert [(label, int(args[23])) for _, _, label, args in calls] == [("o", 1 | PREWAIT_ROWS), ("down", 1)]


@pytest.mark.parametrize("setting", [None, ()])
def test_the_int8_qkv_gemv_runs_its_3_blocks_an_sm_build_in_one_round(setting):
    """KernelSettings.qkv_one_round (default ("int8",)): Mistral-7B's int8 q|k|v GEMV launches gemv_quant.cu's _3b
    kernel over 384 blocks (3072 row pairs, 8 a block, one round), where the 2-blocks-an-SM build takes 192
    blocks of two rounds; int4's q|k|v and every other GEMV keep the 2-block build."""
    calls = []
    settings = KernelSettings() if setting is None else KernelSettings(qkv_one_round=setting)
    k = quant_launcher(settings, calls)
    qkv = (None, None, None, None, 32, 8, 128)                         # no cache: RoPE only
    for method in ("int8", "int4"):
        k._quant("gemv_qkv_v4", quant_matrix(method, 6144, 4096), None, "gain", 1e-5, None, 3072, label="qkv",
                 qkv=qkv)
        k._quant("gemv_v4", quant_matrix(method, 4096, 4096), None, None, 0.0, None, 2048, True, "o")
    got = [(name, grid[0]) for name, grid, _, _ in calls]
    first = ("gemv_rmsnorm_qkv_int8_3b", 384) if setting is None else ("gemv_rmsnorm_qkv_int8", 192)
    assert got == [first, ("gemv_int8", 256), ("gemv_rmsnorm_qkv_int4", 192), ("gemv_int4", 256)]
    with pytest.raises(ValueError, match="'int8' and/or '16-bit'"):
        KernelSettings(qkv_one_round=("int4",))


@pytest.mark.parametrize("one_round", [(), ("16-bit",)])
def test_the_16_bit_qkv_gemv_runs_its_6_blocks_an_sm_build_when_asked(one_round):
    """qkv_one_round with "16-bit": the decode step's q|k|v GEMV launches gemv.cu's _6b kernel (same grid: its 768
    blocks all resident at 6 an SM), every other launch as before."""
    calls = decode_launches(KernelSettings(qkv_one_round=one_round))
    default = decode_launches(KernelSettings(qkv_one_round=()))
    qkv = {(name, label) for name, label, _ in calls if label == "qkv"}
    assert qkv == {("gemv_rmsnorm_qkv_v4_6b" if one_round else "gemv_rmsnorm_qkv_v4", "qkv")}
    others = lambda launches: [(name, label) for name, label, _ in launches if label != "qkv"]
    assert others(calls) == others(default) and len(others(calls)) == len(calls) - MISTRAL.n_layers


@pytest.mark.parametrize("flags", [0, GQA_PREFETCH_KV])
def test_attention_flags_reach_the_group_kernel(flags):
    """attention_gqa*'s arguments: the 11 shared ones, split_keys, max_splits, flags, then the scratch."""
    calls = decode_launches(KernelSettings(attention_flags=flags))
    attention = [args for name, _, args in calls if name == "attention_gqa4"]
    assert len(attention) == MISTRAL.n_layers
    assert {int(args[13]) for args in attention} == {flags}


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
