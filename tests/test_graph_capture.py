"""minillm.cuda.graph on the CPU, with a stream that records: `capture`, which makes the decode steps' graphs
(GraphDecode, the shell gpu_model and gpu_mla share) and cuda.timing's (the H200 suite replays them against
eager), and GraphDecode's capture-once-then-replay rule."""
from __future__ import annotations

import types

import pytest

from minillm.cuda.graph import GraphDecode, capture


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
    """One decode shell: both GPU models take theirs from GraphDecode, which captures through `capture`, as
    GPUTransformer.capture_with_cublas does (the verify pass, the batching graphs); nothing opens its own."""
    import inspect
    from minillm.cuda import gpu_mla, gpu_model, graph
    assert issubclass(gpu_model.GPUTransformer, graph.GraphDecode)
    assert issubclass(gpu_mla.GPUMLATransformer, graph.GraphDecode)
    for cls in (gpu_model.GPUTransformer, gpu_mla.GPUMLATransformer):
        assert not {"decode", "_step", "_graph_for"} & set(vars(cls)), f"{cls.__name__} has its own decode shell"
    assert "capture(self.stream, lambda: self.decode_step(cache, n_layers))" in inspect.getsource(graph.GraphDecode)
    assert inspect.getsource(gpu_mla).count("begin_capture") == 0
    assert inspect.getsource(gpu_model).count("begin_capture") == 0      # capture_with_cublas captures through it too
    assert "capture(self.stream," in inspect.getsource(gpu_model.GPUTransformer.capture_with_cublas)


class ShellStream(RecordingStream):
    """A stream a GraphDecode model can enter, capture on and replay on (recording each)."""
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass

    def end_capture(self):
        self.calls.append("end")
        return types.SimpleNamespace(launch=lambda stream: self.calls.append("replay"))


class Buffer:
    def __init__(self, value=None):
        self.value = value

    def set(self, value):
        self.value = value

    def get(self):
        return self.value


class ShellModel(GraphDecode):
    def __init__(self, use_graph=True, settings="defaults"):
        self.stream, self.use_graph = ShellStream(), use_graph
        self.k = types.SimpleNamespace(settings=settings)
        self.step, self.logits = Buffer(), Buffer("logits")

    def decode_step(self, cache, n_layers=None):
        self.stream.calls.append(("step", n_layers, tuple(self.step.value)))

    def _decode_parts(self, cache):
        self.stream.calls.append("scratch")


class ShellCache:
    graph = graph_key = None
    length, max_seq_len = 0, 8

    def end_of_write(self, n):
        if self.length + n > self.max_seq_len:
            raise ValueError("KV cache is full")

    def advance(self, n):
        self.length += n


def test_the_decode_shell_captures_once_per_cache_depth_and_settings_then_replays():
    model, cache = ShellModel(), ShellCache()
    assert model.decode(7, cache) == "logits" and model.decode(8, cache) == "logits"
    assert model.stream.calls == ["scratch", "begin", ("step", None, (7, 0)), "end", "replay", "replay"]
    assert model.step.value.tolist() == [8, 1] and cache.length == 2        # the token and position replay reads
    model.stream.calls.clear()
    model.decode(9, cache, n_layers=1)                       # another depth: its own capture
    other = ShellModel(settings="changed")
    other.decode(10, cache)                                  # another model (or its settings): captured again
    assert model.stream.calls[1:4] == ["begin", ("step", 1, (9, 2)), "end"]
    assert other.stream.calls[1:4] == ["begin", ("step", None, (10, 3)), "end"]


def test_the_decode_shell_runs_eagerly_without_graphs_and_refuses_a_full_cache():
    model, cache = ShellModel(use_graph=False), ShellCache()
    model.decode(3, cache)
    assert model.stream.calls == [("step", None, (3, 0))]
    cache.length = cache.max_seq_len
    with pytest.raises(ValueError, match="full"):
        model.decode(4, cache)
    assert len(model.stream.calls) == 1
