"""Prefill's quantized matrices widened to 16 bits one GEMM ahead, on a second stream.

With int8/int4 weights, prefill widens each matrix into a 16-bit scratch right before its cuBLAS GEMM, so
the full 16-bit model never exists in memory. The widening is memory-bound and the GEMM at T = 512
compute-bound, yet on one stream they take turns: ~6 ms of Mistral-7B's 20 ms TTFT was widening (H200,
lessons/BENCHMARKS.md). Here matrix j + 1 is widened on a side stream, into the other of two scratch buffers,
while matrix j's GEMM runs:

    side:  widen 0 | widen 1        | widen 2        | widen 3 ...
    main:          | GEMM 0 ....... | GEMM 1 ....... | GEMM 2 ...

Two kinds of event order it. GEMM j waits for widen j (`ready[j % 2]`). Widen j + 1 overwrites the buffer
GEMM j - 1 read, so it waits for everything main had enqueued when GEMM j was about to be (`free`). Inside a
CUDA graph capture the same waits become the graph's edges: the side stream forks from main at its first
wait and joins it at every GEMM's.

Importing this module does not import CuPy.
"""
from __future__ import annotations


class WidenAhead:
    """One prefill's widening plan: `order` is every quantized matrix its GEMMs will read, in the order they
    read them; dense(w) is called right before each GEMM with that GEMM's matrix and returns its 16-bit view.

    widen(w, out): enqueue w widened into out on the current stream (Kernels.dequantize);
    buffers: two 1-D 16-bit device arrays, each as large as the largest matrix;
    main, side: the prefill's stream and the one the widening runs on; events: three CuPy events."""

    def __init__(self, widen, order: list, buffers, main, side, events):
        self.widen, self.order, self.buffers = widen, order, buffers
        self.main, self.side = main, side
        self.free, *self.ready = events
        self.next = 0                                   # index of the matrix the next GEMM reads

    def dense(self, w):
        """The 16-bit copy of w (the next matrix in the plan) for its GEMM, main ordered after its widening;
        the matrix after it starts widening now."""
        j = self.next
        if j >= len(self.order) or self.order[j] is not w:
            raise RuntimeError("prefill read a quantized matrix out of the order its widening was planned in")
        if j == 0:
            self._widen(0)
        if j + 1 < len(self.order):
            self._widen(j + 1)
        self.main.wait_event(self.ready[j % 2])
        self.next = j + 1
        return self._view(j)

    def done(self) -> bool:
        """Has every planned matrix been handed to its GEMM?"""
        return self.next == len(self.order)

    def _view(self, j: int):
        rows, n_in = self.order[j].shape
        return self.buffers[j % 2][:rows * n_in].reshape(rows, n_in)

    def _widen(self, j: int) -> None:
        self.free.record(self.main)                     # main so far: the last GEMM that read buffer j % 2
        self.side.wait_event(self.free)
        with self.side:
            self.widen(self.order[j], self._view(j))
        self.ready[j % 2].record(self.side)
