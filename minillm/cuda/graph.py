"""Capturing a stream's launches as a CUDA graph, in one place: `capture` makes the decode steps' graphs
(GraphDecode, the decode shell GPUTransformer and GPUMLATransformer share), the timers' (cuda/timing.py) and,
through GPUTransformer.capture_with_cublas (which keeps a refused capture's reason), the verify pass's and the
batching engine's."""
from __future__ import annotations

import numpy as np


def capture(stream, fn):
    """fn()'s launches on `stream` (a cupy.cuda.Stream), captured as a CUDA graph and not run: replay it
    with graph.launch(stream). The capture is ended even when fn raises: a stream left capturing would
    refuse every later launch."""
    stream.begin_capture()
    try:
        fn()
    finally:
        graph = stream.end_capture()
    return graph


class GraphDecode:
    """The decode shell GPUTransformer and GPUMLATransformer share: the token and position into the device
    buffer `step`, then the model's decode step replayed as a CUDA graph (or launched eagerly, use_graph=False),
    the logits copied back. The model provides decode_step(cache, n_layers) and _decode_parts(cache) (its
    scratch, allocated before a capture)."""

    def _hold(self, config, layers, embed, final_norm, lm_head, dtype: str, use_graph: bool, kernels) -> None:
        """What both models hold: the weights, their Kernels and stream, and the first buffers of a decode step,
        allocated once so a captured graph's pointers stay valid: step [token, position] int32 (read by the
        kernels) and the residual stream x [1, dim] fp32 (the model adds its own, the logits last)."""
        import cupy as cp
        self.config, self.layers, self.dtype, self.use_graph = config, layers, dtype, use_graph
        self.embed, self.final_norm, self.lm_head = embed, final_norm, lm_head
        self.k, self.n_sms, self.stream = kernels, kernels.n_sms, cp.cuda.Stream(non_blocking=True)
        self.step = cp.zeros(2, dtype=cp.int32)
        self.step_tokens, self.step_pos = self.step[0:1], self.step[1:2]
        self.x = cp.zeros((1, config.dim), cp.float32)
        self._parts: dict[int, tuple] = {}               # flash-decoding splits -> the decode step's scratch

    def decode(self, token: int, cache, n_layers: int | None = None):
        """Run one new position against the cache.  -> logits [vocab] (host fp32)
        n_layers: early exit, as in prefill (its own graph: a cache is decoded at one depth)."""
        cache.end_of_write(1)                           # refuses to run past the capacity
        return self._step(token, cache, True, n_layers)

    def _step(self, token: int, cache, fetch: bool, n_layers: int | None = None):
        with self.stream:
            self.step.set(np.array([token, cache.length], dtype=np.int32))
            if self.use_graph:
                self._graph_for(cache, n_layers).launch(self.stream)
            else:
                self.decode_step(cache, n_layers)
            logits = self.logits.get() if fetch else None
            self.stream.synchronize()
        cache.advance(1)
        return logits

    def _graph_for(self, cache, n_layers: int | None = None):
        """The decode step captured as a CUDA graph for this cache (on first use; again when the model, the
        depth or the kernel settings it was captured with change: the graph bakes them in)."""
        key = (self, n_layers, self.k.settings)
        if cache.graph is None or cache.graph_key != key:
            self._decode_parts(cache)                    # allocate scratch before capturing
            cache.graph = capture(self.stream, lambda: self.decode_step(cache, n_layers))
            cache.graph_key = key
        return cache.graph
