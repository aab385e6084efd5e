"""minillm.cuda.graph.capture, on the CPU with a stream that records: the decode steps' graphs (gpu_model,
gpu_mla) and dev.timing's are captured by it (the H200 suite replays them against eager)."""
from __future__ import annotations

import pytest

from minillm.cuda.graph import capture


class RecordingStream:
    def __init__(self):
        self.calls = []

    def begin_capture(self):
        self.calls.append("begin")

    def end_capture(self):
        self.calls.append("end")
        return f"graph of {self.calls[1:-1]}"


def test_the_launches_between_begin_and_end_are_the_graph():
    stream = RecordingStream()
    graph = capture(stream, lambda: stream.calls.append("launch"))
    assert stream.calls == ["begin", "launch", "end"] and graph == "graph of ['launch']"


def test_a_failing_step_still_ends_the_capture_and_its_error_propagates():
    stream = RecordingStream()

    def step():
        raise RuntimeError("kernel refused")
    with pytest.raises(RuntimeError, match="kernel refused"):
        capture(stream, step)
    assert stream.calls == ["begin", "end"]


def test_the_decode_graphs_are_captured_by_it():
    """One capture idiom: neither decode step opens its own begin_capture."""
    import inspect
    from minillm.cuda import gpu_mla, gpu_model
    for mod in (gpu_model, gpu_mla):
        assert "capture(self.stream, lambda: self.decode_step(cache, n_layers))" in inspect.getsource(mod)
    assert inspect.getsource(gpu_mla).count("begin_capture") == 0
    assert inspect.getsource(gpu_model).count("begin_capture") == 1      # capture_with_cublas's, which keeps the error
