"""The quantized GEMV v4 (minillm/cuda/dev/kernels/gemv_quant_tma.cu) without a GPU: the lab's split of each
matrix (lab.tma_plan), the kernel's indexing replayed in Python (every row pair's every chunk computed exactly
once, every epilogue applied once), and what LabKernels._quant launches. The kernel's numbers against float64 are
checked on the GPU by `python -m minillm.cuda.dev.qtma` (tests/gpu/ runs it)."""
from __future__ import annotations

import numpy as np
import pytest

from minillm.cuda.dev.qmma import random_layout
from minillm.cuda.dev.qtma import KERNELS, coverage
from minillm.cuda.dev.lab import (TMA_CHUNKS_A_THREAD, TMA_MAX_PAIRS, TMA_MAX_STAGES, TMA_THREADS, VARIANTS, LabKernels,
                                  lab_settings, tma_plan)

RING = lab_settings().quant_tma_ring_bytes


def chunks_and_groups(method: str, n_in: int, group: int = 128) -> tuple[int, int]:
    """A row's 16-byte chunks and int4 groups, as qweights lays them out (16-bit weights: 8 a chunk)."""
    if method == "wide16":
        return n_in // 8, 0
    if method == "int8":
        return -(-n_in // 16), 0
    groups = -(-n_in // group)
    return groups * group // 32, groups


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("n_in", [1024, 2048, 4096, 14336, 16384])
def test_plans_fit_the_ring_and_the_registers(method, n_in):
    n_chunks, n_groups = chunks_and_groups(method, n_in)
    plan = tma_plan(method, n_chunks, n_groups, RING)
    consumers = TMA_THREADS - 32
    assert plan is not None
    assert plan.lanes in (32, 64, 128, 256) and consumers % plan.lanes == 0
    assert n_chunks <= TMA_CHUNKS_A_THREAD[method] * plan.lanes            # x fits a thread's registers
    assert plan.lanes == 32 or n_chunks > TMA_CHUNKS_A_THREAD[method] * plan.lanes // 2   # and no wider than needed
    assert 1 <= plan.pairs_a_stage <= TMA_MAX_PAIRS and 2 <= plan.stages <= TMA_MAX_STAGES
    assert plan.stage_bytes == plan.pairs_a_stage * 2 * (16 * n_chunks + (4 * n_groups if method == "int4" else 0))
    assert plan.smem <= RING
    # two blocks an SM: the rings and the kernels' static shared memory (2.2 KB) fit the H200's 228 KB
    assert 2 * (plan.smem + 2208 + 1024) <= 228 * 1024


def test_mistral_shapes_get_their_intended_split():
    """4096 wide: 64 threads a row (int4 2 chunks each, int8 4), 4 slots, stages of 4 pairs; 14336 wide: a
    whole block a row, a pair a stage."""
    p = tma_plan("int4", *chunks_and_groups("int4", 4096), RING)
    assert (p.lanes, p.pairs_a_stage, p.stages) == (64, 4, 6)
    p = tma_plan("int8", *chunks_and_groups("int8", 4096), RING)
    assert (p.lanes, p.pairs_a_stage, p.stages) == (64, 4, 3)
    p = tma_plan("int4", *chunks_and_groups("int4", 14336), RING)
    assert (p.lanes, p.pairs_a_stage, p.stages) == (256, 1, 6)
    p = tma_plan("int8", *chunks_and_groups("int8", 14336), RING)
    assert (p.lanes, p.pairs_a_stage, p.stages) == (256, 1, 3)


def test_where_v4_does_not_apply_there_is_no_plan():
    assert tma_plan("int8", *chunks_and_groups("int8", 16384 + 16), RING) is None    # > 4 chunks a thread
    assert tma_plan("int4", *chunks_and_groups("int4", 16384 + 128), RING) is None   # > 2 chunks a thread
    assert tma_plan("int4", *chunks_and_groups("int4", 576), RING) is None           # 5 groups: 10-byte scales
    assert tma_plan("int8", *chunks_and_groups("int8", 14336), 40 << 10) is None     # one 28 KB stage only


@pytest.mark.parametrize("method,n_in,pairs,grid", [
    ("int4", 4096, 2048, 264), ("int8", 4096, 3072, 264), ("int4", 14336, 41, 16), ("int8", 14336, 9, 4),
    ("int4", 1024, 17, 3), ("int8", 1024, 17, 300), ("int8", 160, 5, 2), ("int4", 256, 77, 5),
    ("wide16", 14336, 7, 3), ("wide16", 4096, 33, 5), ("wide16", 200, 9, 2),
])
def test_every_pair_and_chunk_is_computed_once(method, n_in, pairs, grid):
    n_chunks, n_groups = chunks_and_groups(method, n_in, 32 if n_in == 256 else 128)
    plan = tma_plan(method, n_chunks, n_groups, 200 << 10 if method == "wide16" else RING)   # 1 block an SM: 200 KB
    got = coverage(plan, method, pairs, n_chunks, grid)
    want = {(p, c) for p in range(pairs) for c in range(n_chunks)}
    assert set(got["products"]) == want
    assert set(got["products"].values()) == {1}
    assert got["epilogues"] == {p: 1 for p in range(pairs)}
    assert got["copies_fit"]


def _launches(method: str, n_in: int, name: str = "gemv_v4", group: int = 128, rows: int = 4096, **settings):
    """What LabKernels._quant launches for a quantized matrix (no GPU: the launch is recorded, not run)."""
    from minillm.cuda.qweights import QuantMatrix
    k = object.__new__(LabKernels)                    # no __init__: nothing is compiled or loaded
    k.settings = lab_settings(**settings)
    k.n_sms, k.max_quant_smem = 132, 227 * 1024
    k._nil_f32 = k._nil_u16 = k._nil_i32 = object()
    calls = []
    k._launch = lambda name, grid, block, args, label="", shared_mem=0: calls.append(
        (name, grid, block, shared_mem, args))
    q, s, m = random_layout(method, 2, n_in, group, np.random.default_rng(0))
    w = QuantMatrix(method, np.zeros((rows, q.shape[1]), q.dtype), s, m, n_in, group)
    pairs = rows // 2 if "swiglu" in name else -(-rows // 2)
    k._quant(name, w, None, None, 0.0, None, pairs)
    return calls


def test_quant_version_4_launches_the_tma_kernels():
    """Mistral-7B's down (int4): a pair a stage, 2048 stages over 264 blocks of 288 threads, six 15 KB stages,
    and (L, P, stages) as the last three arguments; gate_up's SwiGLU twin: 4 pairs a stage."""
    (name, grid, block, smem, args), = _launches("int4", 14336, quant_version=4)
    assert (name, grid, block, smem) == ("gemv_int4_v4", (264,), (288,), 6 * 2 * (7168 + 448))
    assert [int(a) for a in args[-3:]] == [256, 1, 6]
    (name, grid, _, smem, args), = _launches("int4", 4096, "gemv_swiglu_v4", rows=28672, quant_version=4)
    assert (name, grid, smem) == ("gemv_swiglu_int4_v4", (264,), 6 * 4 * 2 * (2048 + 128))
    (name, grid, _, _, _), = _launches("int8", 4096, rows=100, quant_version=4)   # 50 pairs: 13 stages
    assert (name, grid) == ("gemv_int8_v4", (13,))


def test_v4_hands_over_to_v2_where_it_does_not_apply():
    (name, _, block, _, args), = _launches("int4", 576, quant_version=4)           # 5 groups a row
    assert (name, block) == ("gemv_int4", (256,))
    assert len(args) == 23                                                       # v2's signature, no (L, P, stages)
    (name, _, _, _, _), = _launches("int8", 16384 + 16, quant_version=4)
    assert name == "gemv_int8"


def test_the_launcher_and_the_dev_module_name_the_same_kernels():
    assert ({f"gemv_{e}{m}_v4_{{sfx}}" for m in ("int8", "int4") for e in VARIANTS}
            | {f"gemv_{e}tma_{{sfx}}" for e in VARIANTS} == set(KERNELS.values()))


def test_the_chunks_a_thread_holds_are_the_kernels_own():
    import re

    from minillm.cuda.dev.lab import LAB_KERNEL_DIR
    text = (LAB_KERNEL_DIR / "gemv_quant_tma.cu").read_text()
    held = {m.lower(): int(j) for m, j in re.findall(r"struct (Int[48])Tma : PackedTma<\d+, (\d+), \w+>", text)}
    held |= {"wide16": int(j) for j in re.findall(r"static constexpr int C = 8, J_MAX = (\d+);", text)}
    assert held == TMA_CHUNKS_A_THREAD


def _wide_launches(rows: int, n_in: int, name: str = "gemv_v4", **settings):
    k = object.__new__(LabKernels)
    k.settings = lab_settings(**settings)
    k.n_sms = 132
    k._nil_f32 = k._nil_u16 = k._nil_i32 = object()
    calls = []
    k._launch = lambda name, grid, block, args, label="", shared_mem=0: calls.append(
        (name, grid, block, shared_mem, args))
    k._v4(name, np.zeros((rows, n_in), np.float16), None, None, 0.0, None, -(-rows // 2))
    return calls


def test_wide_tma_launches_the_16_bit_twin_and_hands_over_where_it_does_not_fit():
    """Mistral-7B's fp16 down: gemv.cu v4 under the default 104 KB ring; one block an SM with a 200 KB ring:
    three 57 KB stages of a pair; a row wider than 7 chunks a
    thread (14344 > 7 · 256 · 8) stays on gemv.cu v4, as does everything with wide_tma off."""
    (name, _, block, _, _), = _wide_launches(4096, 14336, wide_tma=True)                # one 57 KB stage only
    assert (name, block) == ("gemv_v4", (128,))
    (name, grid, block, smem, args), = _wide_launches(4096, 14336, wide_tma=True, wide_tma_blocks_per_sm=1,
                                                      wide_tma_ring_bytes=200 << 10)
    assert (name, grid, block, smem) == ("gemv_tma", (132,), (288,), 3 * 2 * 14336 * 2)
    assert [int(a) for a in args[-3:]] == [256, 1, 3] and int(args[3]) == 14336 // 8
    (name, _, block, _, _), = _wide_launches(40, 14344, wide_tma=True)
    assert (name, block) == ("gemv_v4", (128,))
    (name, _, _, _, _), = _wide_launches(4096, 4096)
    assert name == "gemv_v4"


def test_the_dev_modules_case_list_is_built_without_a_gpu():
    """qtma.cases (what `python -m minillm.cuda.dev.qtma` hands run_cases) names every case once, each a check
    of its own settings: building the list runs no kernel, so a slip in it shows here and not on the device."""
    from minillm.cuda.dev import qtma

    class Recorder:
        def with_settings(self, **changes):
            return changes
    listed = qtma.cases(Recorder())
    assert [label for label, _ in listed] == list(qtma.CASE_LABELS)
    assert all(callable(run) for _, run in listed)
