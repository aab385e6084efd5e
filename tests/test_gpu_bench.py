"""`minillm bench --device cuda` (tools/gpu_bench.py) on the CPU, its GPU parts stood in for (NumPy arrays, a model
that records what it is asked, timers that time nothing): one report for 16-bit and int8/int4 weights runs through
every section, the graph's tokens differing from eager launches' make the exit status 1, and an HF peer that cannot
start is one line. Speed is the GPU machine's to measure, never asserted here."""
import sys
import types

import numpy as np
import pytest

from minillm.cuda import gpu_model, selfcheck
from minillm.model.config import ModelConfig
from minillm.tools import gpu_bench, hf_peer


def kernel(name):
    def launch(self, *args, **kw):
        if self.timer is not None:                     # as the real Kernels: each launch through the timer
            self.timer(name, lambda: None)
    return launch


class Kernels:
    timer = None
    gemv, gemv_qkv, gemv_swiglu = kernel("gemv_v4"), kernel("gemv_qkv_v4"), kernel("gemv_swiglu_v4")
    gemv_rmsnorm, attention = kernel("gemv_v4"), kernel("attention_gqa")


class Matrix:
    def __init__(self, rows, cols, quant):
        self.shape, self.nbytes = (rows, cols), rows * cols * (2 if quant is None else 1)


class Model:
    """The attributes of GPUTransformer that gpu_bench uses, on NumPy arrays."""

    def __init__(self, cfg, quant):
        c, hd = cfg, cfg.head_dim
        self.config, self.k = cfg, Kernels()
        self.qkv_width = (c.n_heads + 2 * c.n_kv_heads) * hd
        mat = (lambda rows, cols: np.zeros((rows, cols), np.float16)) if quant is None else \
            (lambda rows, cols: Matrix(rows, cols, quant))
        self.layers = [types.SimpleNamespace(wqkv=mat(self.qkv_width, c.dim), wo=mat(c.dim, c.n_heads * hd),
                                             w_gate_up=mat(2 * c.ffn_dim, c.dim), w_down=mat(c.dim, c.ffn_dim))
                       for _ in range(c.n_layers)]
        self.lm_head = np.zeros((c.vocab_size, c.dim), np.float16)
        self.weight_bytes = sum(w.nbytes for L in self.layers for w in vars(L).values()) + self.lm_head.nbytes
        self.step = types.SimpleNamespace(set=lambda host: None)          # a device array's host-to-device copy
        self.step_pos, self.inv_freq = np.zeros(1, np.int32), np.ones(hd // 2)
        self.qkv, self.attn, self.logits = np.zeros((1, self.qkv_width)), np.zeros((1, c.dim)), np.zeros(c.vocab_size)
        self.use_graph, self.gemms = True, []

    stream = property(lambda self: Stream())

    def new_cache(self, n):
        return types.SimpleNamespace(k=[None] * self.config.n_layers, v=[None] * self.config.n_layers, length=0,
                                     reset=lambda: None)

    def _decode_parts(self, cache):
        return None

    def with_options(self, use_graph=True):
        other = Model.__new__(Model)
        other.__dict__ = self.__dict__ | {"use_graph": use_graph}
        return other

    def gemm(self, a, w, out, accumulate=False):
        self.gemms.append(w)

    def decode_step(self, cache):
        for L in self.layers:
            self.k.gemv_qkv(L.wqkv)
            self.k.attention()
            self.k.gemv(L.wo)

    def prefill(self, prompt, cache):
        for L in self.layers:
            self.gemm(None, L.wqkv, None)
            self.k.attention()
        self.k.gemv(self.lm_head)


class Stream:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


class EventTimer:
    def __init__(self):
        self.seen = {}

    def __call__(self, name, launch):
        launch()
        self.seen[name] = self.seen.get(name, 0) + 1

    def totals(self):
        return {name: (n, 0.01 * n) for name, n in self.seen.items()}


@pytest.fixture
def stand_ins(monkeypatch):
    """The GPU parts stood in for; -> the tokens the graph decodes (the test may change them)."""
    fake_cp = types.SimpleNamespace(ones=np.ones, empty=np.empty, float32=np.float32, ndarray=np.ndarray,
                                    cuda=types.SimpleNamespace(Device=lambda: types.SimpleNamespace(synchronize=lambda: None)),
                                    get_default_memory_pool=lambda: types.SimpleNamespace(free_all_blocks=lambda: None))
    monkeypatch.setitem(sys.modules, "cupy", fake_cp)
    monkeypatch.setattr(gpu_model.GPUTransformer, "random",
                        staticmethod(lambda cfg, dtype, seed=0, quant=None, group_size=128: Model(cfg, quant)))
    graph_tokens = [1, 2, 3]
    monkeypatch.setattr(gpu_bench, "copy_bandwidth", lambda nbytes: 3e12)
    monkeypatch.setattr(gpu_bench, "graph_us", lambda fn, n: [fn(i) for i in range(n)] and 10.0)
    monkeypatch.setattr(gpu_bench, "time_gpu", lambda fn, reps: fn() and 0.05)
    monkeypatch.setattr(gpu_bench, "EventTimer", EventTimer)
    monkeypatch.setattr(gpu_bench, "prefill_ttft", lambda gpu, cache, prompt: 0.0146)
    monkeypatch.setattr(gpu_bench, "decode_tok_s", lambda gpu, cache, prompt, n: (
        (150.0, [1, 2, 3]) if not gpu.use_graph else (190.0, graph_tokens)))
    monkeypatch.setattr(selfcheck, "FAILED", [])
    monkeypatch.setattr(gpu_bench, "FAILED", selfcheck.FAILED)
    return graph_tokens


@pytest.mark.parametrize("quant", [None, "int8", "int4"])
def test_one_report_for_every_format_with_its_reference(stand_ins, quant, capsys):
    assert gpu_bench.run("mistral-7b", _small_mistral(), quant=quant, peer=False) == 0
    out = capsys.readouterr().out
    for section in ("copy bandwidth", "one decode step's kernels", "prefill 512 tokens: TTFT 14.6 ms",
                    "graph tokens == eager tokens", "one decode step, per kernel", "cuBLAS gemm qkv", "summary"):
        assert section in out, section
    assert ("cuBLAS µs" in out) == (quant is None)                 # cuBLAS beside our GEMVs: 16-bit weights only
    decode = next(line for line in out.splitlines() if line.strip().startswith("decode tok/s "))
    assert "190.0" in decode and "reference: " in decode          # the current figure of this shape and format


def test_graph_tokens_that_differ_from_eager_fail_the_run_and_a_missing_peer_is_one_line(stand_ins, monkeypatch,
                                                                                           capsys):
    stand_ins[:] = [1, 2, 4]

    def no_peer(**kw):
        raise hf_peer.PeerError("the HF peer process stopped (exit 1): ModuleNotFoundError: No module named 'torch'")
    monkeypatch.setattr(hf_peer, "HFPeer", no_peer)
    assert gpu_bench.run("mistral-7b", _small_mistral(), peer=True) == 1
    out = capsys.readouterr().out
    assert "FAIL  mistral-7b fp16 decode: graph tokens == eager tokens" in out
    skipped = [line for line in out.splitlines() if "HF transformers" in line]
    assert skipped == ["HF transformers comparison skipped: the HF peer process stopped (exit 1): "
                       "ModuleNotFoundError: No module named 'torch'"]


def _small_mistral():
    return ModelConfig(vocab_size=64, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, max_seq_len=1024,
                       family="mistral", sliding_window=1024)
