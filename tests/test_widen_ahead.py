"""WidenAhead (minillm/cuda/dev/widen_ahead.py, the lab's LabSettings.prefill_widen_ahead) on the CPU, with streams and events that only record what they
are asked: each GEMM's matrix is widened before the GEMM reads it, and never over a buffer a GEMM still reads,
whatever the two streams' speeds; and GPUTransformer plans the widening in its layer loop's GEMM order.
The numbers (logits with and without it, bit for bit) are checked on the GPU (tests/test_cuda_widen_ahead.py)."""
from __future__ import annotations

import numpy as np
import pytest

from minillm.cuda.dev.widen_ahead import WidenAhead


class Timeline:
    """Two streams' enqueued operations and the event waits between them, for happens-before questions."""

    def __init__(self):
        self.ops: list[tuple[str, str]] = []           # (stream, what)
        self.waits: list[tuple[int, str, int]] = []     # (op index the wait precedes, stream, op index waited on)
        self.current = "main"

    def add(self, stream: str, what: str) -> None:
        self.ops.append((stream, what))

    def before(self, a: int, b: int) -> bool:
        """Must op a finish before op b starts? Through stream order and event waits, transitively."""
        seen, todo = set(), [b]
        while todo:
            x = todo.pop()
            for y in range(x):                                          # same stream, earlier
                if self.ops[y][0] == self.ops[x][0] and y not in seen:
                    seen.add(y)
                    todo.append(y)
            for at, stream, on in self.waits:                          # a wait enqueued before x on x's stream
                if stream == self.ops[x][0] and at <= x and on not in seen:
                    seen.add(on)
                    todo.append(on)
        return a in seen


class Stream:
    def __init__(self, line: Timeline, name: str):
        self.line, self.name = line, name

    def wait_event(self, event) -> None:
        if event.at is not None:
            self.line.waits.append((len(self.line.ops), self.name, event.at))

    def __enter__(self):
        self.saved, self.line.current = self.line.current, self.name

    def __exit__(self, *exc):
        self.line.current = self.saved


class Event:
    def __init__(self, line: Timeline):
        self.line, self.at = line, None

    def record(self, stream: Stream) -> None:      # the last op enqueued on that stream so far
        mine = [i for i, (s, _) in enumerate(self.line.ops) if s == stream.name]
        self.at = mine[-1] if mine else None


def run_plan(n: int):
    """n matrices through a WidenAhead, a GEMM enqueued on main after each dense(); -> (timeline, views)."""
    line = Timeline()
    main, side = Stream(line, "main"), Stream(line, "side")
    mats = [np.zeros((4 + j, 8)) for j in range(n)]
    buffers = (np.zeros(1000), np.zeros(1000))

    def widen(w, out):
        line.add(line.current, f"widen {next(j for j, m in enumerate(mats) if m is w)} -> {out.base is buffers[1]:d}")
    plan = WidenAhead(widen, mats, buffers, main, side, (Event(line), Event(line), Event(line)))
    views = []
    line.add("main", "embed")
    for j, w in enumerate(mats):
        views.append(plan.dense(w))
        line.add("main", f"gemm {j} <- {views[-1].base is buffers[1]:d}")
    assert plan.done()
    return line, views


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_each_gemm_reads_its_matrix_widened_and_no_widening_overwrites_a_buffer_in_use(n):
    line, views = run_plan(n)
    index = {what: i for i, (_, what) in enumerate(line.ops)}
    gemm = [index[f"gemm {j} <- {j % 2}"] for j in range(n)]        # GEMM j reads buffer j % 2
    widen = [index[f"widen {j} -> {j % 2}"] for j in range(n)]
    assert all(line.ops[i][0] == "side" for i in widen) and all(line.ops[i][0] == "main" for i in gemm)
    for j in range(n):
        assert line.before(widen[j], gemm[j])                       # widened before it is read
        if j >= 2:
            assert line.before(gemm[j - 2], widen[j])              # the buffer's last reader is done first
        if j >= 1:
            assert not line.before(gemm[j - 1], widen[j])           # ... but the GEMM just ahead runs alongside
    assert [v.shape for v in views] == [(4 + j, 8) for j in range(n)]
    assert line.before(index["embed"], widen[0])                     # after what main had queued before it


def test_a_matrix_out_of_the_planned_order_is_refused():
    line = Timeline()
    a, b = np.zeros((2, 2)), np.zeros((2, 2))
    plan = WidenAhead(lambda w, out: None, [a, b], (np.zeros(8), np.zeros(8)), Stream(line, "main"),
                      Stream(line, "side"), (Event(line), Event(line), Event(line)))
    with pytest.raises(RuntimeError, match="out of the order"):
        plan.dense(b)


def test_the_model_plans_its_layer_loops_quantized_gemms_in_order():
    """Every layer's qkv, o, gate_up, down (the order forward.run_layers' GEMMs read them), quantized ones
    only; nothing to plan with the setting off, without quantized weights, or before the buffers exist."""
    from minillm.course.gpu_parts import recording_model
    from minillm.cuda.dev.lab import lab_settings
    from minillm.cuda.qweights import QuantMatrix
    from minillm.model.config import PRESETS
    from test_qtma_plan import random_layout
    cfg = PRESETS["smollm2-135m"].config
    m, _, _ = recording_model(cfg, settings=lab_settings(prefill_widen_ahead=True))
    assert m._plan_widening(m.layers) is None                        # 16-bit weights: nothing to widen
    q, s, mins = random_layout("int8", 2, 64, 128, np.random.default_rng(0))
    quant = lambda: QuantMatrix("int8", q, s, mins, 64, 128)
    for L in m.layers:
        L.wqkv, L.wo, L.w_gate_up, L.w_down = quant(), quant(), quant(), quant()
    m._dense_scratch, m.stream = np.zeros(8), "main"
    m._ahead_parts = (np.zeros(8), "side", ("free", "ready0", "ready1"))
    plan = m._plan_widening(m.layers[:2])
    L0, L1 = m.layers[:2]
    assert plan.order == [L0.wqkv, L0.wo, L0.w_gate_up, L0.w_down, L1.wqkv, L1.wo, L1.w_gate_up, L1.w_down]
    assert plan.main == "main" and plan.side == "side" and plan.buffers[0] is m._dense_scratch
    off, _, _ = recording_model(cfg, settings=lab_settings(prefill_widen_ahead=False))
    off.layers, off._dense_scratch, off._ahead_parts = m.layers, m._dense_scratch, m._ahead_parts
    assert off._plan_widening(off.layers) is None
