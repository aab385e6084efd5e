"""The batching engine on the GPU: paged attention against NumPy, the device forward pass against the CPU's,
and the engine's greedy outputs through paging, prefix caching and preemption.

Two halves. The first runs anywhere: gpu_batched.py's forward pass (GPUBatchedRunner) over NumPy arrays
through CPUOps (cuda/dev/cpu_ops.py), the CPU engine's own functions, against the CPU BatchedRunner, and the engine driving
that runner, so the plumbing (packing, slots, block tables, positions) is checked without a GPU. The
second needs CuPy and a CUDA device (skipped otherwise): the kernels against their NumPy references
(cuda/dev/paged_attention.py), the device runner against the CPU engine, the engine on the device.

Why greedy outputs are checked "teacher-forced" rather than token for token: the device computes in
fp16 and cuBLAS picks different kernels for different batch shapes, so at a near-tie (two logits closer
than fp16 noise) the argmax may differ from the CPU's, and one flip changes everything after it. So for
each request we run the CPU model (fp32 math on the same fp16-rounded weights) once over prompt + the
engine's output, and check that every token the engine chose is the CPU's argmax at that position or
within fp16 noise of it (GREEDY_TOL), and that nearly all are the argmax exactly. A real bug (a wrong
slot, table, position or mask) gives logits unrelated to the CPU's: its picks land far below the max.
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

from minillm.backend import to_dtype
from minillm.engine.batched import BatchedRunner, CPUBatching, SeqChunk
from minillm.cuda.dev.common import narrow
from minillm.cuda.dev.model import MODEL_TOL, random_cpu_model, small_config
from minillm.cuda.dev.paged_attention import (lab_ops, paged_attention_group_reference, paged_attention_reference,
                                              paged_kv_write_reference, rope_at_positions_reference)
from minillm.cuda.dev.sampling import argmax_rows_reference, tricky_logits
from minillm.cuda.dev.cpu_ops import CPUOps
from minillm.cuda.gpu_batched import (DevicePagedKV, GPUBatchedRunner, batch_meta, bucket_for,
                                      decode_meta_into, meta_size, meta_views)
from minillm.engine.engine import Engine
from minillm.llm import LLM
from minillm.engine.paged_kv import PagedKVCache
from minillm.engine.sampling import Sampler, SamplingParams

try:
    import cupy as cp
    _N_DEVICES = cp.cuda.runtime.getDeviceCount()
except Exception:      # no CuPy, no driver, or a driver too old for this CuPy
    cp, _N_DEVICES = None, 0
needs_gpu = pytest.mark.skipif(_N_DEVICES == 0, reason="no CuPy or no CUDA device")

GREEDY_TOL = 0.05          # logits are O(1) here (max ≈ 3); fp16 noise in them is ~1e-2
LOGITS_TOL = MODEL_TOL["float16"]      # relative to the largest |logit|
# int8 pools: both sides quantize K/V, but from slightly different values (the device path narrows GEMM inputs
# to fp16, the CPU does not), so a value near a rounding boundary takes the next code. Measured with the
# NumPy emulation of the device path (removed since): 1.6-2.8e-3 (16-bit pools: 4-5e-4); the bound is about 3.5x that.
INT8_LOGITS_TOL = 1e-2
LENGTHS = [3, 40, 17, 9, 26, 1]


def small(kind: str = "gqa", **changes):
    """A small config with no EOS (every request runs to max_tokens) and room for the prompts."""
    return small_config(kind, eos_token_id=None, max_seq_len=256, **changes)


def prompts(lengths=LENGTHS, prefix=(), seed=7):
    rng = np.random.default_rng(seed)
    return [list(prefix) + rng.integers(3, 500, n).tolist() for n in lengths]


def to_f32(a):
    return to_dtype(a, "float32")


def rel(got, want) -> float:
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


def schedule_by_hand(block_size: int, num_blocks: int, seed: int = 0):
    """Three steps of a mixed batch, with block tables scattered over the pool (not 0, 1, 2, ...):
    step 1 prefills a (20 tokens) and b (7); step 2 decodes a, prefills the rest of b, starts c (5 of 9);
    step 3 decodes a and b, finishes c's prompt. -> list of steps, each a list of SeqChunk"""
    rng = np.random.default_rng(seed)
    free = rng.permutation(num_blocks).tolist()
    take = lambda n: [free.pop() for _ in range(n)]
    toks = lambda n: rng.integers(3, 500, n).tolist()
    ta, tb, tc = take(-(-23 // block_size)), take(-(-14 // block_size)), take(-(-10 // block_size))
    a, b, c = toks(23), toks(14), toks(9)
    return [[SeqChunk(a[:20], 0, ta), SeqChunk(b[:7], 0, tb)],
            [SeqChunk(a[20:21], 20, ta), SeqChunk(b[7:13], 7, tb), SeqChunk(c[:5], 0, tc)],
            [SeqChunk(a[21:22], 21, ta), SeqChunk(b[13:14], 13, tb), SeqChunk(c[5:9], 5, tc)]]


def assert_teacher_forced_greedy(cpu_model, prompt_list, results):
    """Each engine token is the CPU's greedy choice given the same prefix, up to fp16 noise (see top)."""
    exact = total = 0
    for prompt, result in zip(prompt_list, results):
        out = result.token_ids
        assert out, "no tokens came back"
        ids = prompt + out
        logits = cpu_model.prefill(ids, cpu_model.new_cache(len(ids)), all_logits=True)   # [L, vocab]
        rows = logits[len(prompt) - 1:len(ids) - 1]                                        # [len(out), vocab]
        chosen = rows[np.arange(len(out)), out]
        assert np.all(chosen >= rows.max(axis=1) - GREEDY_TOL), (rows.max(axis=1) - chosen).max()
        exact += int((rows.argmax(axis=1) == np.asarray(out)).sum())
        total += len(out)
    assert exact >= 0.9 * total, f"only {exact} of {total} tokens are the CPU's argmax"


# ---- anywhere: the runner over NumPy arrays, through the CPU engine's ops ---------------------------

def test_the_kernels_the_paged_ops_launch_are_defined(monkeypatch):
    """A typo in a kernel name would otherwise surface only on the GPU machine: the names forward.DeviceOps
    fetches, for every dtype, GQA group (the group kernels, and the per-head fallback for a group of 3) and head
    size (the tensor-core prefill at 64 and 128, the paged kernels alone at 96), are all defined in the .cu files."""
    import re
    from types import SimpleNamespace
    from minillm.cuda import forward
    from minillm.cuda.kernels import KERNEL_DIR, SOURCES
    sources = ("paged_attention", "sampling", "prefill_attention_mma")
    assert set(sources) <= set(SOURCES)                          # so test_kernels_compile builds them
    defined = set()
    for name in sources:
        text = (KERNEL_DIR / f"{name}.cu").read_text()
        defined |= set(re.findall(r'extern "C" __global__ void (\w+)\(', text))
        defined |= set(re.findall(r'^PAGED_\w+_KERNEL\((\w+),', text, re.M))
    fetched = []
    monkeypatch.setattr(forward, "module", lambda name: SimpleNamespace(get_function=lambda f: fetched.append(f) or f))
    monkeypatch.setattr(forward, "_cp", lambda: np)
    monkeypatch.setattr(forward, "device_dtype", lambda dtype: np.float16)
    for dtype in ("float16", "bfloat16"):
        for group, hd in [(1, 64), (2, 128), (4, 64), (8, 128), (3, 64), (4, 96)]:
            config = SimpleNamespace(n_heads=group * 2, n_kv_heads=2, head_dim=hd)
            ops = forward.DeviceOps(SimpleNamespace(config=config, dtype=dtype, k=None))
            assert (ops.group is None) == (group == 3) and ("prefill" in ops.fn) == (hd != 96)
    assert "argmax_rows" in fetched and "paged_attention_f16" in fetched and "paged_attention_g8_bf16" in fetched
    assert set(fetched) <= defined, set(fetched) - defined


def test_batch_meta_points_each_row_at_its_own_slot():
    chunks = [SeqChunk([5, 6, 7], 0, [9, 2]), SeqChunk([8], 17, [4, 0, 3])]       # block size 8
    m = batch_meta(chunks, 8, np.asarray)
    assert m.positions.tolist() == [0, 1, 2, 17] and m.seq_of_row.tolist() == [0, 0, 0, 1]
    assert m.slots.tolist() == [9 * 8, 9 * 8 + 1, 9 * 8 + 2, 3 * 8 + 1]               # 17 = block 2, offset 1
    assert m.block_tables.tolist() == [[9, 0, 0], [4, 0, 3]] and m.last_rows.tolist() == [2, 3]
    assert m.tokens.dtype == np.int32


@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_reference_equals_the_cpu_gather(window):
    """The reference the kernel is tested against agrees with paged_kv.read + grouped_attention."""
    from minillm.model.attention import grouped_attention
    config = small("gqa")
    rng = np.random.default_rng(3)
    pool = PagedKVCache(config, 12, 4)
    pool.k[0] = rng.standard_normal(pool.k[0].shape)
    pool.v[0] = rng.standard_normal(pool.v[0].shape)
    chunks = [SeqChunk([1] * 6, 3, [7, 2, 11]), SeqChunk([1], 9, [0, 5, 8])]
    m = batch_meta(chunks, 4, np.asarray)
    qkv = rng.standard_normal((7, (config.n_heads + 2 * config.n_kv_heads) * config.head_dim)).astype(np.float32)
    got = paged_attention_reference(qkv, pool.k[0], pool.v[0], m.block_tables, m.seq_of_row, m.positions,
                                    config.n_heads, window)
    q = qkv[:, :config.n_heads * config.head_dim].reshape(7, config.n_heads, config.head_dim)
    for rows, c in ((slice(0, 6), chunks[0]), (slice(6, 7), chunks[1])):
        k, v = pool.read(0, c.block_table, c.end)
        np.testing.assert_allclose(got[rows], grouped_attention(q[rows], k, v, window), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [dict(), dict(dim=512, n_heads=4, n_kv_heads=1), dict(n_kv_heads=8)],
                         ids=["gqa", "mqa", "mha"])
@pytest.mark.parametrize("window", [None, 5])
def test_the_group_reference_equals_the_per_head_reference(shape, window):
    """paged_attention_g{G}'s reference (one K/V gather per group) gives the per-head reference's numbers."""
    config = small("gqa", **shape)
    rng = np.random.default_rng(6)
    pool = PagedKVCache(config, 12, 4)
    pool.k[0], pool.v[0] = rng.standard_normal(pool.k[0].shape), rng.standard_normal(pool.v[0].shape)
    m = batch_meta([SeqChunk([1] * 6, 3, [7, 2, 11]), SeqChunk([1], 9, [0, 5, 8])], 4, np.asarray)
    qkv = rng.standard_normal((7, (config.n_heads + 2 * config.n_kv_heads) * config.head_dim)).astype(np.float32)
    args = (qkv, pool.k[0], pool.v[0], m.block_tables, m.seq_of_row, m.positions, config.n_heads, window)
    np.testing.assert_allclose(paged_attention_group_reference(*args), paged_attention_reference(*args),
                               rtol=1e-5, atol=1e-5)


def test_gpu_batching_takes_graphs_from_the_model_and_ships_one_kernel_choice():
    """Graphs on when the model decodes by graph (or as asked); the paged kernels are not a setting (DeviceOps
    picks by shape: forward.py), so asking for one is an error, not a silent default. No environment variable
    is read."""
    from types import SimpleNamespace
    from minillm.cuda.gpu_batched import GPUBatching
    on, off = SimpleNamespace(use_graph=True), SimpleNamespace(use_graph=False)
    assert GPUBatching(on).use_graph and not GPUBatching(off).use_graph and not GPUBatching(on, use_graph=False).use_graph
    for choice in (dict(attention="head"), dict(prefill="paged")):
        with pytest.raises(TypeError):
            GPUBatching(on, **choice)


def test_batch_meta_knows_its_longest_chunk_on_the_host():
    """What sizes the prefill kernel's grid: the rows of the longest chunk, a host int (1 for decodes)."""
    steps = schedule_by_hand(4, 24)
    assert [batch_meta(s, 4, np.asarray).longest_chunk for s in steps] == [20, 6, 4]
    assert batch_meta([SeqChunk([5], 9, [0, 1, 2])], 4, np.asarray).longest_chunk == 1
    assert meta_views(np.zeros(meta_size(4, 3), np.int32), 4, 3).longest_chunk == 1


def test_the_host_overhead_probe_times_each_part_of_a_step():
    """python -m minillm.tools.serve_host on a few steps: every part timed, the parts within the whole step."""
    from minillm.tools.serve_host import measure
    for temperature in (0.0, 0.8):
        ms = measure(users=8, steps=4, temperature=temperature, prompt_len=16, tokenizer=None)
        # greedy: no sampler runs, the runner hands back token ids (forward_greedy)
        assert set(ms) == {"schedule", "pack", "detokenize", "step"} | ({"sample"} if temperature else set())
        assert all(v > 0 for v in ms.values()) and ms["schedule"] + ms["pack"] + ms.get("sample", 0) < ms["step"]


def _on_numpy(cpu, pool: PagedKVCache, use_graph: bool = False) -> GPUBatchedRunner:
    """The GPU's batched runner over the CPU model and a CPU pool, its steps done by the CPU engine's ops
    (use_graph: decode steps through the bucket path, its "graph" a rerun over the same static buffers)."""
    return GPUBatchedRunner(cpu, pool, CPUOps(cpu, pool), use_graph=use_graph)


def test_decode_meta_pads_to_the_bucket_with_slots_that_write_nothing():
    assert [bucket_for(b) for b in (1, 3, 5, 17, 64, 65, 256)] == [1, 4, 8, 24, 64, 96, 256]
    assert bucket_for(257) is None
    chunks = [SeqChunk([5], 17, [4, 0, 3]), SeqChunk([8], 2, [9])]                 # block size 8
    flat = np.full(meta_size(4, 5), 77, np.int32)                                  # stale contents
    decode_meta_into(flat, chunks, 8, 4, 5)
    m = meta_views(flat, 4, 5)
    assert m.tokens.tolist() == [5, 8, 0, 0] and m.positions.tolist() == [17, 2, 0, 0]
    assert m.slots.tolist() == [3 * 8 + 1, 9 * 8 + 2, -1, -1]
    assert m.seq_of_row.tolist() == m.last_rows.tolist() == [0, 1, 2, 3]
    assert m.block_tables.tolist() == [[4, 0, 3, 0, 0], [9, 0, 0, 0, 0]] + [[0] * 5] * 2


class _StreamRecordingOps(CPUOps):
    """CPUOps that records, for each device allocation and upload, whether it was made inside ops.stream()."""

    def __init__(self, model, pool):
        super().__init__(model, pool)
        self.inside, self.calls = False, []

    @contextlib.contextmanager
    def stream(self):
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    def _record(name):
        def call(self, *args, **kwargs):
            self.calls.append((name, self.inside))
            return getattr(CPUOps, name)(self, *args, **kwargs)
        return call

    zeros_f32, zeros_narrow, zeros_i32 = _record("zeros_f32"), _record("zeros_narrow"), _record("zeros_i32")
    copy_in = _record("copy_in")


def test_a_bucket_graph_allocates_its_buffers_on_the_models_stream():
    """The zero-fills of a bucket's metadata and buffers run on the model's stream, ahead of the metadata's upload.
    On the default stream, which the model's non-blocking stream does not wait for, a late fill zeroed the
    metadata after its upload and the warm-up step wrote K/V into slot 0 of block 0 (seen once on the H200, in
    test_gpu_decode_graph_gives_the_eager_logits_and_pool: a block no sequence held; a live one would be overwritten)."""
    cpu = random_cpu_model(small("gqa"), "float16")
    pool = PagedKVCache(cpu.config, 24, 4, "float32")
    ops = _StreamRecordingOps(cpu, pool)
    runner = GPUBatchedRunner(cpu, pool, ops, use_graph=True)
    assert runner.graph_for(4) is not None
    names = [name for name, _ in ops.calls]
    assert {"zeros_f32", "zeros_narrow", "zeros_i32", "copy_in"} <= set(names)
    assert all(inside for _, inside in ops.calls), [name for name, inside in ops.calls if not inside]


@pytest.mark.parametrize("kv", ["auto", "int8"])
@pytest.mark.parametrize("kind", ["gqa", "mistral"])
def test_a_padded_decode_step_gives_the_real_rows_logits_and_writes_nothing_else(kind, kv):
    """3 decodes padded to bucket 4 (the graph path, its "replay" rerun on NumPy) against the same 3
    unpadded (the eager path): the same logits, and the same pool bytes afterwards, so the padded row's
    slot -1 wrote nowhere (the pools start poisoned with random values, so a write to block 0 would show)."""
    config = small(kind)
    cpu = random_cpu_model(config, "float16")
    storage = "int8" if kv == "int8" else "float32"
    pools = [PagedKVCache(config, 24, 4, storage) for _ in range(2)]
    rng = np.random.default_rng(4)
    for name in ("k", "v", "k_scale", "v_scale"):
        if hasattr(pools[0], name):
            a = getattr(pools[0], name)
            a[...] = rng.integers(-100, 100, a.shape) if a.dtype == np.int8 else rng.random(a.shape)
            getattr(pools[1], name)[...] = a
    eager, padded = _on_numpy(cpu, pools[0]), _on_numpy(cpu, pools[1], use_graph=True)
    prefill, decode, _ = schedule_by_hand(4, 24)
    eager.forward(prefill), padded.forward(prefill)                    # mixed: eager on both
    step = decode[:1] + [SeqChunk([7], 3, prefill[1].block_table), SeqChunk([9], 6, prefill[1].block_table)]
    want, got = eager.forward(step), padded.forward(step)
    assert list(padded.graphs) == [4] and padded.graph_error is None and not eager.graphs
    assert got.shape == want.shape == (3, config.vocab_size)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # the same bytes, except in the real rows' own slots, where a 4-row matmul may round otherwise than a 3-row
    # one (BLAS picks kernels by shape: seen on one machine's CPUs, not another's)
    written = {c.block_table[c.start // 4] * 4 + c.start % 4 for c in step}          # block size 4
    for name in ("k", "v", "k_scale", "v_scale"):
        if hasattr(pools[0], name):
            a, b = getattr(pools[0], name), getattr(pools[1], name)   # [layers, blocks, bs, n_kv(, hd)]
            differ = np.argwhere(a != b)
            assert {int(block) * 4 + int(off) for block, off in differ[:, 1:3]} <= written, name
            if a.dtype == np.int8:
                assert np.abs(a.astype(int) - b).max() <= 1
            else:
                np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * np.abs(a).max())   # fp32 rounding


@pytest.mark.parametrize("kv", ["auto", "int8"])
@pytest.mark.parametrize("kind", ["gqa", "mistral", "hd64"])
def test_the_gpu_runner_on_numpy_matches_the_cpu_batched_path(kind, kv):
    """Same weights, same ops, same pool format: any difference is the GPU runner's packing, slots, block
    tables or positions (batch_meta), which the device path uses unchanged."""
    config = small(kind)
    cpu = random_cpu_model(config, "float16")
    storage = "int8" if kv == "int8" else "float32"
    cpu_runner = BatchedRunner(cpu, PagedKVCache(config, 24, 4, storage))
    runner = _on_numpy(cpu, PagedKVCache(config, 24, 4, storage))
    for step in schedule_by_hand(4, 24):
        want = cpu_runner.forward(step)                                       # [B, vocab]
        got = runner.forward(step)
        assert got.shape == want.shape == (len(step), config.vocab_size)
        assert rel(got, want) < (INT8_LOGITS_TOL if kv == "int8" else LOGITS_TOL)
        assert rel(got, want) < 1e-5                                          # only summation order may differ


def test_the_int8_pool_holds_what_the_cpu_int8_pool_holds():
    """DevicePagedKV("int8") written by the kernel's reference: the same codes and scales as PagedKVCache("int8").write,
    read back (code · scale) the same, in about half the 16-bit pool's bytes."""
    config = small("gqa")
    cpu_pool, pool = PagedKVCache(config, 6, 4, "int8"), DevicePagedKV(config, 6, 4, "int8", xp=np)
    rng = np.random.default_rng(2)
    n_kv, hd = config.n_kv_heads, config.head_dim
    qkv = rng.standard_normal((7, (config.n_heads + 2 * n_kv) * hd)).astype(np.float32)
    table, slots = [5, 1], np.array([20, 21, 22, 23, 4, 5, 6])              # 7 positions, blocks 5 then 1
    k_pool, v_pool, scales = pool.layer(1)
    paged_kv_write_reference(qkv, slots, k_pool, v_pool, config.n_heads, n_kv, hd, scales=scales)
    nq = config.n_heads * hd
    cpu_pool.write(1, slots // 4, slots % 4, qkv[:, nq:nq + n_kv * hd].reshape(7, n_kv, hd),
                   qkv[:, nq + n_kv * hd:].reshape(7, n_kv, hd))
    for name in ("k", "v", "k_scale", "v_scale"):
        np.testing.assert_array_equal(getattr(pool, name), getattr(cpu_pool, name))
    for got, want in zip(pool.read(1, table, 7), cpu_pool.read(1, table, 7)):
        np.testing.assert_array_equal(got, want)
    per_block = DevicePagedKV.bytes_per_block_for(config, 4, "int8")      # (hd + 4) / 2hd of the 16-bit's
    assert pool.nbytes == 6 * per_block
    assert per_block * 2 * hd == DevicePagedKV.bytes_per_block_for(config, 4) * (hd + 4)


class OnNumpy(CPUBatching):
    """The CPU pool, but the GPU's batched runner over it (through CPUOps): what an Engine gets handed."""
    use_graph = False

    def new_runner(self, pool):
        return _on_numpy(self.model, pool, self.use_graph)


class OnNumpyGraphs(OnNumpy):
    use_graph = True


def _numpy_engine(cpu, graphs: bool = False, **options) -> Engine:
    """An Engine on the CPU model whose runner is the GPU's, handed over by the LLM (as load does on cuda)."""
    engine = Engine(LLM(cpu.config, cpu, batching=(OnNumpyGraphs if graphs else OnNumpy)(cpu)), **options)
    assert isinstance(engine.runner, GPUBatchedRunner)
    return engine


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "buckets"])
@pytest.mark.parametrize("kind,kv", [("gqa", "auto"), ("mistral", "auto"), ("gqa", "int8")])
def test_the_engine_with_the_gpu_runner_on_numpy_greedy_through_preemption(kind, kv, graphs):
    """mistral (window 6): the scheduler gives back the blocks behind the window (FREED table entries),
    which the device block tables carry and paged attention never reads. int8: the int8 pool, checked
    against the CPU model with the int8 KV cache."""
    cpu = random_cpu_model(small(kind), "float16").with_options(kv_cache=kv)   # int8: the reference too
    options = dict(num_blocks=16, block_size=4) if kind == "gqa" else dict(num_blocks=4, block_size=4,
                                                                           max_batch_tokens=4)
    engine = _numpy_engine(cpu, graphs, **options)
    assert engine.pool.dtype == ("int8" if kv == "int8" else "float32")
    results = engine.generate(prompts(), max_tokens=16)
    assert bool(engine.runner.graphs) == graphs                  # buckets: decode steps took the padded path
    assert engine.stats()["preemptions"] > 0 and engine.stats()["blocks_used"] == 0
    assert [len(r.token_ids) for r in results] == [16] * len(LENGTHS)
    assert_teacher_forced_greedy(cpu, prompts(), results)


# ---- greedy steps: token ids from the runner (argmax_rows on the device) -----------------------------

@pytest.mark.parametrize("vocab", [1, 31, 100, 1000, 4099])
@pytest.mark.parametrize("threads", [32, 96, 1024])
def test_the_argmax_kernels_order_is_np_argmax_on_ties_and_nans(vocab, threads):
    """argmax_rows' scan and reduction (its NumPy model) under its one order (NaN first, then the larger value,
    then the lower index) pick what np.argmax and the greedy Sampler pick, on rows whose maximum is tied
    across threads and warps, rows with NaNs, all NaN, all -inf, +inf ties and -0.0 == 0.0; so does CPUOps."""
    x = tricky_logits(np.random.default_rng(vocab + threads), 40, vocab)
    want = np.array([Sampler(SamplingParams())(row) for row in x])
    assert (argmax_rows_reference(x, threads) == want).all()
    ops = CPUOps.__new__(CPUOps)                             # its argmax needs no model
    assert ops.argmax(x).dtype == np.int32 and (ops.argmax(x) == want).all()
    if vocab >= 100:                                         # the rows do poison: first and last maximum differ
        ties = [r for r in x if not np.isnan(r).any() and np.flatnonzero(r == r.max()).size > 1]
        assert ties and any(np.isnan(r).sum() > 1 for r in x)


def test_a_reduction_without_the_index_rule_would_be_caught(monkeypatch):
    """The tricky rows tell a wrong order apart: "the larger value wins, ties keep what you hold" (the reduction
    then returns whichever tied entry reached lane 0 first) differs from np.argmax on them."""
    from minillm.cuda.dev import sampling
    x = tricky_logits(np.random.default_rng(0), 40, 1000)
    right = argmax_rows_reference(x, 64)
    monkeypatch.setattr(sampling, "beats", lambda a, ia, b, ib: (a > b) | (np.isnan(a) & ~np.isnan(b)))
    assert (argmax_rows_reference(x, 64) != right).any()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "buckets"])
def test_forward_greedy_on_numpy_is_the_argmax_of_forward(graphs):
    """Two GPU runners on NumPy, one asked for ids, one for logits, over the same steps (mixed, then decodes
    padded to buckets): int32 ids, each the argmax of the other's row."""
    config = small("gqa")
    cpu = random_cpu_model(config, "float16")
    ids_runner = _on_numpy(cpu, PagedKVCache(config, 24, 4), use_graph=graphs)
    logits_runner = _on_numpy(cpu, PagedKVCache(config, 24, 4), use_graph=graphs)
    prefill, decode, _ = schedule_by_hand(4, 24)
    ta, tb = prefill[0].block_table, prefill[1].block_table
    for step in [prefill, [SeqChunk([11], 20, ta), SeqChunk([12], 7, tb), SeqChunk([13], 3, tb)]]:
        ids, logits = ids_runner.forward_greedy(step), logits_runner.forward(step)
        assert ids.dtype == np.int32 and ids.shape == (len(step),)
        assert ids.tolist() == logits.argmax(axis=1).tolist()
    assert sorted(ids_runner.graphs) == sorted(logits_runner.graphs) == ([4] if graphs else [])


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "buckets"])
def test_the_engine_on_numpy_emits_the_same_greedy_tokens_with_ids_or_logits(graphs):
    """The Engine over the GPU runner on NumPy, greedy through preemption: device_greedy (ids from
    forward_greedy, from the graph's ids buffer when bucketed) and the logits path give the same streams."""
    cpu = random_cpu_model(small("gqa"), "float16")
    on, off = (_numpy_engine(cpu, graphs, num_blocks=16, block_size=4, device_greedy=d) for d in (True, False))
    called = []
    forward_greedy = on.runner.forward_greedy
    on.runner.forward_greedy = lambda chunks: called.append(len(chunks)) or forward_greedy(chunks)
    got, want = on.generate(prompts(), max_tokens=16), off.generate(prompts(), max_tokens=16)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert called and on.stats()["preemptions"] > 0 and bool(on.runner.graphs) == graphs


# ---- on the device ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models():
    """(cpu, gpu) for a few shapes: the CPU model holds the fp16-rounded weights the GPU got."""
    from minillm.cuda.gpu_model import GPUTransformer
    out = {}
    for kind in ("gqa", "mistral", "hd64"):
        cpu = random_cpu_model(small(kind), "float16")
        out[kind] = (cpu, GPUTransformer.from_cpu(cpu, "float16"))
    return out


@needs_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", [dict(), dict(dim=512, n_heads=4, n_kv_heads=1), dict(n_kv_heads=8)],
                         ids=["gqa-hd16", "mqa-hd128", "mha-hd16"])
@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize("attention", ["head", "group"])
def test_paged_kernels_match_numpy(dtype, shape, window, attention):
    """rope_at_positions, paged_kv_write and paged_attention (a block per head, or per GQA group) against their
    references, on a mixed batch with scattered block tables; every output poisoned (NaN) before the kernels run."""
    from minillm.cuda.gpu_model import GPUTransformer
    config = small("gqa", sliding_window=window or None, **shape)
    gpu = GPUTransformer.from_cpu(random_cpu_model(config, dtype), dtype)
    c, inv_freq = config, cp.asnumpy(gpu.inv_freq)
    dev = lab_ops(gpu, attention=attention, prefill="paged")
    assert (dev.group is not None) == (attention == "group")
    steps = schedule_by_hand(4, 24, seed=1)
    chunks = steps[2]                                          # decodes and a prefill chunk, together
    rng = np.random.default_rng(5)
    pool_h = DevicePagedKV(config, 24, 4, dtype, xp=np)
    pool_h.k[0] = narrow(rng.standard_normal(pool_h.k[0].shape), dtype)   # earlier positions' K/V
    pool_h.v[0] = narrow(rng.standard_normal(pool_h.v[0].shape), dtype)
    pool_d = DevicePagedKV(config, 24, 4, dtype)
    pool_d.k[0], pool_d.v[0] = cp.asarray(pool_h.k[0]), cp.asarray(pool_h.v[0])
    meta_h, meta_d = batch_meta(chunks, 4, np.asarray), batch_meta(chunks, 4, cp.asarray)
    N = sum(len(c.token_ids) for c in chunks)
    qkv_h = rng.standard_normal((N, (config.n_heads + 2 * config.n_kv_heads) * config.head_dim)).astype(np.float32)
    qkv_d = cp.asarray(qkv_h)
    cp.cuda.Device().synchronize()          # the copies above ran on the default stream, the kernels won't
    with gpu.stream:
        rope_at_positions_reference(qkv_h, meta_h.positions, inv_freq, c.n_heads, c.n_kv_heads, c.head_dim)
        dev.rope(qkv_d, meta_d)
        paged_kv_write_reference(qkv_h, meta_h.slots, pool_h.k[0], pool_h.v[0], c.n_heads, c.n_kv_heads, c.head_dim,
                                 dtype)
        dev.write_kv(qkv_d, meta_d.slots, pool_d.k[0], pool_d.v[0])
        out = cp.full((N, config.n_heads * config.head_dim), cp.nan, cp.float32)
        dev.attend(qkv_d, pool_d.k[0], pool_d.v[0], meta_d, out=out)
        gpu.stream.synchronize()
    np.testing.assert_allclose(cp.asnumpy(qkv_d), qkv_h, rtol=1e-5, atol=1e-5)       # RoPE in place
    ulp = 1e-3 if dtype == "float16" else 1.6e-2           # cosf vs np.cos may round a k differently
    for d, h in ((pool_d.k[0], pool_h.k[0]), (pool_d.v[0], pool_h.v[0])):            # every slot, written or not
        np.testing.assert_allclose(to_f32(cp.asnumpy(d)), to_f32(h), rtol=ulp, atol=ulp)
    # attention alone: the reference reads exactly what the kernel read (the device's qkv and pool)
    want = paged_attention_reference(cp.asnumpy(qkv_d), cp.asnumpy(pool_d.k[0]), cp.asnumpy(pool_d.v[0]),
                                     meta_h.block_tables, meta_h.seq_of_row, meta_h.positions, c.n_heads, window)
    got = cp.asnumpy(out)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


@needs_gpu
@pytest.mark.parametrize("shape", [dict(), dict(dim=512, n_heads=4, n_kv_heads=1), dict(n_kv_heads=8)],
                         ids=["gqa-hd16", "mqa-hd128", "mha-hd16"])
@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize("attention", ["head", "group"])
def test_paged_int8_kernels_match_numpy(shape, window, attention):
    """paged_kv_write_int8: the codes and scales its reference (quantize_int8, as the CPU's int8 pool) makes from
    the same rotated qkv, exactly; paged_attention_int8 against the reference over code · scale. Every
    output poisoned first (pool codes 99, scales NaN; attention NaN)."""
    from minillm.cuda.gpu_model import GPUTransformer
    config = small("gqa", sliding_window=window or None, **shape)
    gpu = GPUTransformer.from_cpu(random_cpu_model(config, "float16"), "float16")
    c = config
    dev = lab_ops(gpu, attention=attention, prefill="paged")
    chunks = schedule_by_hand(4, 24, seed=1)[2]                # decodes and a prefill chunk, together
    rng = np.random.default_rng(5)
    pool_d = DevicePagedKV(config, 24, 4, "int8")
    for a in (pool_d.k, pool_d.v):                              # earlier positions: random codes and scales
        a[0] = cp.asarray(rng.integers(-127, 128, a[0].shape).astype(np.int8))
    for a in (pool_d.k_scale, pool_d.v_scale):
        a[0] = cp.asarray((0.01 + rng.random(a[0].shape) / 20).astype(np.float32))
    meta_h, meta_d = batch_meta(chunks, 4, np.asarray), batch_meta(chunks, 4, cp.asarray)
    N = sum(len(c.token_ids) for c in chunks)
    qkv_d = cp.asarray(rng.standard_normal((N, (config.n_heads + 2 * config.n_kv_heads) * config.head_dim)),
                       cp.float32)
    cp.cuda.Device().synchronize()          # the copies above ran on the default stream, the kernels won't
    with gpu.stream:
        dev.rope(qkv_d, meta_d)
        gpu.stream.synchronize()
        qkv_h = cp.asnumpy(qkv_d)
        want = {name: cp.asnumpy(getattr(pool_d, name)[0]) for name in ("k", "v", "k_scale", "v_scale")}
        paged_kv_write_reference(qkv_h, meta_h.slots, want["k"], want["v"], c.n_heads, c.n_kv_heads, c.head_dim,
                                 scales=(want["k_scale"], want["v_scale"]))
        flat = lambda a: a.reshape(-1, *a.shape[2:])           # [blocks * bs, ...]: the written slots
        for a, poison in ((pool_d.k, 99), (pool_d.v, 99), (pool_d.k_scale, cp.nan), (pool_d.v_scale, cp.nan)):
            flat(a[0])[meta_d.slots.astype(cp.int64)] = poison
        k_pool, v_pool, scales = pool_d.layer(0)
        dev.write_kv(qkv_d, meta_d.slots, k_pool, v_pool, scales)
        out = cp.full((N, config.n_heads * config.head_dim), cp.nan, cp.float32)
        dev.attend(qkv_d, k_pool, v_pool, meta_d, out=out, scales=scales)
        gpu.stream.synchronize()
    for name in ("k", "v", "k_scale", "v_scale"):              # every slot, written or not
        np.testing.assert_array_equal(cp.asnumpy(getattr(pool_d, name)[0]), want[name])
    ref = paged_attention_reference(qkv_h, want["k"], want["v"], meta_h.block_tables, meta_h.seq_of_row,
                                    meta_h.positions, c.n_heads, window, scales=(want["k_scale"], want["v_scale"]))
    got = cp.asnumpy(out)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-4)


def prefill_steps(block_size: int, num_blocks: int, seed: int = 3):
    """schedule_by_hand's steps and one more: a 70-token prompt from 0 (several row tiles of 64 rows), a
    chunk of 33 that continues at position 30 (its first 30 keys already in the pool), and a decode at 12."""
    rng = np.random.default_rng(seed)
    free = rng.permutation(num_blocks).tolist()
    take = lambda n: [free.pop() for _ in range(-(-n // block_size))]
    toks = lambda n: rng.integers(3, 500, n).tolist()
    big = [SeqChunk(toks(70), 0, take(70)), SeqChunk(toks(33), 30, take(63)), SeqChunk(toks(1), 12, take(13))]
    return schedule_by_hand(block_size, 24, seed=1) + [big]


@needs_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", [dict(dim=256, n_heads=4, n_kv_heads=2), dict(dim=512, n_heads=4, n_kv_heads=1),
                                   dict(dim=512, n_heads=8, n_kv_heads=8)], ids=["gqa-hd64", "mqa-hd128", "mha-hd64"])
@pytest.mark.parametrize("window", [0, 6, 40])
def test_paged_prefill_mma_matches_numpy(dtype, shape, window):
    """paged_prefill_attention_mma (every chunk of a step in one launch, K/V through the block tables) against
    paged_attention_reference, on prompt chunks from 0 and from the middle of a sequence, with decodes among
    them; the pool random everywhere, the output NaN-poisoned first. Tolerance: the kernel rounds q and the
    probabilities to 16 bits (as prefill_attention_mma, test_cuda.py)."""
    from minillm.cuda.dev.common import TOL
    from minillm.cuda.gpu_model import GPUTransformer
    from minillm.cuda.forward import DeviceOps
    config = small("gqa", sliding_window=window or None, **shape)
    c = config
    gpu = GPUTransformer.from_cpu(random_cpu_model(config, dtype), dtype)
    dev = DeviceOps(gpu)
    assert "prefill" in dev.fn
    rng = np.random.default_rng(11)
    pool = DevicePagedKV(config, 64, 4, dtype)
    pool.k[0] = cp.asarray(narrow(rng.standard_normal(pool.k[0].shape), dtype))
    pool.v[0] = cp.asarray(narrow(rng.standard_normal(pool.v[0].shape), dtype))
    for chunks in prefill_steps(4, 64):
        meta = batch_meta(chunks, 4, cp.asarray)
        N = int(meta.positions.shape[0])
        qkv = cp.asarray(rng.standard_normal((N, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim)).astype(np.float32))
        cp.cuda.Device().synchronize()
        with gpu.stream:
            dev.write_kv(qkv, meta.slots, pool.k[0], pool.v[0])     # the chunks' own keys, as the layer does
            out = cp.full((N, c.n_heads * c.head_dim), cp.nan, cp.float32)
            dev.attend(qkv, pool.k[0], pool.v[0], meta, out=out)
            gpu.stream.synchronize()
        want = paged_attention_reference(cp.asnumpy(qkv), cp.asnumpy(pool.k[0]), cp.asnumpy(pool.v[0]),
                                         cp.asnumpy(meta.block_tables), cp.asnumpy(meta.seq_of_row),
                                         cp.asnumpy(meta.positions), c.n_heads, window)
        got = cp.asnumpy(out)
        assert np.isfinite(got).all()
        assert rel(got, want) < TOL[dtype], (meta.longest_chunk, rel(got, want))


@needs_gpu
@pytest.mark.parametrize("prefill", ["mma", "paged"])
@pytest.mark.parametrize("options", [dict(), dict(max_batch_tokens=8), dict(num_blocks=16, block_size=4)],
                         ids=["default", "chunked-prefill", "tiny-pool-preempts"])
def test_gpu_engine_with_either_prefill_attention_decodes_like_the_cpu(models, options, prefill):
    """Prompt steps on paged_prefill_attention_mma (shipped) or on the paged kernels (its fallback, forced here
    through the lab's ops); greedy outputs teacher-forced against the CPU model either way."""
    from minillm.cuda.gpu_batched import GPUBatching
    cpu, gpu = models["hd64"]
    engine = Engine(LLM(gpu.config, gpu, batching=GPUBatching(gpu)), **options)
    engine.runner.ops = lab_ops(gpu, engine.runner.pool, prefill=prefill)
    assert ("prefill" in engine.runner.ops.fn) == (prefill == "mma")
    results = engine.generate(prompts(), max_tokens=16)
    assert [len(r.token_ids) for r in results] == [16] * len(LENGTHS)
    assert_teacher_forced_greedy(cpu, prompts(), results)


@needs_gpu
@pytest.mark.parametrize("kind", ["gqa", "mistral", "hd64"])
def test_gpu_forward_of_a_mixed_batch_matches_the_cpu_and_the_same_runner_on_numpy(models, kind):
    cpu, gpu = models[kind]
    config = cpu.config
    cpu_runner = BatchedRunner(cpu, PagedKVCache(config, 24, 4))
    on_numpy = _on_numpy(cpu, PagedKVCache(config, 24, 4))              # the same runner code on NumPy
    device = GPUBatchedRunner(gpu, DevicePagedKV(config, 24, 4))
    for step in schedule_by_hand(4, 24):
        want, same_math = cpu_runner.forward(step), on_numpy.forward(step)
        got = device.forward(step)
        assert got.shape == want.shape and np.isfinite(got).all()
        assert rel(got, want) < LOGITS_TOL
        assert rel(got, same_math) < LOGITS_TOL / 2


@needs_gpu
@pytest.mark.parametrize("kv", ["float16", "int8"])
@pytest.mark.parametrize("kind", ["gqa", "mistral"])
@pytest.mark.parametrize("attention", ["head", "group"])
def test_gpu_decode_graph_gives_the_eager_logits_and_pool(models, kind, kv, attention):
    """The same steps through two device runners, one replaying bucket graphs (3 decodes padded to 4, then 1),
    one eager: the same logits up to cuBLAS's choice of kernels for 3 vs 4 rows, the same pool afterwards
    (the padded row wrote nothing)."""
    cpu, gpu = models[kind]
    config = cpu.config
    pools = [DevicePagedKV(config, 24, 4, kv) for _ in range(2)]
    eager, graph = (GPUBatchedRunner(gpu, pool, lab_ops(gpu, pool, attention=attention, prefill="paged"), use_graph=on)
                    for pool, on in zip(pools, (False, True)))
    prefill, decode, _ = schedule_by_hand(4, 24)
    ta, tb = prefill[0].block_table, prefill[1].block_table
    steps = [prefill, [SeqChunk([11], 20, ta), SeqChunk([12], 7, tb), SeqChunk([13], 3, tb)],
             [SeqChunk([14], 21, ta)], [SeqChunk([15], 22, ta), SeqChunk([16], 8, tb), SeqChunk([17], 4, tb)]]
    for step in steps:
        want, got = eager.forward(step), graph.forward(step)
        assert got.shape == want.shape == (len(step), config.vocab_size) and np.isfinite(got).all()
        assert rel(got, want) < LOGITS_TOL / 2
    assert graph.graph_error is None and sorted(graph.graphs) == [1, 4] and not eager.graphs
    for name in ("k", "v", "k_scale", "v_scale"):
        if hasattr(eager.pool, name):
            a, b = (to_f32(cp.asnumpy(getattr(r.pool, name))) if kv != "int8" else cp.asnumpy(getattr(r.pool, name))
                    for r in (eager, graph))
            if a.dtype == np.int8:                  # a code may round the other way: off by one at most
                assert np.abs(a.astype(int) - b).max() <= 1
            else:
                np.testing.assert_allclose(b, a, rtol=2e-3, atol=2e-3)


def _assert_graphs_ran(engine) -> None:
    """The engine's decode steps replayed bucket graphs (with graphs on, the default), none failed."""
    assert engine.runner.use_graph and engine.runner.graphs and engine.runner.graph_error is None


@needs_gpu
@pytest.mark.parametrize("options", [dict(), dict(max_batch_tokens=8), dict(num_blocks=16, block_size=4)],
                         ids=["default", "chunked-prefill", "tiny-pool-preempts"])
def test_gpu_engine_greedy_equals_cpu_greedy(models, options):
    cpu, gpu = models["gqa"]
    engine = Engine(LLM(gpu.config, gpu), **options)
    assert isinstance(engine.runner, GPUBatchedRunner)
    results = engine.generate(prompts(), max_tokens=16)
    assert [len(r.token_ids) for r in results] == [16] * len(LENGTHS)
    assert engine.stats()["blocks_used"] == 0
    if "num_blocks" in options:
        assert engine.stats()["preemptions"] > 0
    _assert_graphs_ran(engine)
    assert_teacher_forced_greedy(cpu, prompts(), results)


@needs_gpu
def test_gpu_engine_greedy_with_graphs_off_equals_the_cpu_too(models):
    """use_graph=False: every step eager (the comparison `serve_step` measures), same greedy outputs."""
    cpu, gpu = models["gqa"]
    engine = Engine(LLM(gpu.config, gpu.with_options(use_graph=False)), num_blocks=16, block_size=4)
    results = engine.generate(prompts(), max_tokens=16)
    assert not engine.runner.graphs and engine.stats()["preemptions"] > 0
    assert_teacher_forced_greedy(cpu, prompts(), results)


@needs_gpu
def test_gpu_engine_prefix_caching_skips_the_prefix_and_keeps_the_outputs(models):
    cpu, gpu = models["mistral"]                              # sliding window 6: the mask crosses blocks
    system = np.random.default_rng(1).integers(3, 500, 37).tolist()   # 2 full blocks of 16, and 5 more
    ps = prompts([4, 11, 20], prefix=system)
    engine = Engine(LLM(gpu.config, gpu))
    first = engine.generate(ps[:1], max_tokens=8)
    before = engine.stats()
    rest = engine.generate(ps[1:], max_tokens=8)
    after = engine.stats()
    assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] == 2 * 32
    assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] == sum(map(len, ps[1:])) - 2 * 32
    _assert_graphs_ran(engine)
    assert_teacher_forced_greedy(cpu, ps, first + rest)


@needs_gpu
def test_gpu_engine_with_the_int8_pool_decodes_like_the_cpu_with_int8_kv(models):
    """kv_cache="int8" on the device: the int8 pool (paged_kv_write_int8, paged_attention_int8), through
    preemption; and a model loaded with the int8 KV cache gets the int8 pool by default."""
    from minillm.cuda.gpu_model import GPUTransformer
    cpu, gpu = models["gqa"]
    engine = Engine(LLM(gpu.config, gpu), kv_cache="int8", num_blocks=16, block_size=4)
    assert engine.pool.dtype == "int8"
    results = engine.generate(prompts(), max_tokens=16)
    assert engine.stats()["preemptions"] > 0 and engine.stats()["blocks_used"] == 0
    _assert_graphs_ran(engine)
    assert_teacher_forced_greedy(cpu.with_options(kv_cache="int8"), prompts(), results)   # quantizes K/V too
    int8_model = GPUTransformer.from_cpu(cpu, "float16", kv_cache="int8")
    assert Engine(LLM(gpu.config, int8_model)).pool.dtype == "int8"
    assert Engine(LLM(gpu.config, gpu)).pool.dtype == "float16"


@needs_gpu
def test_a_new_engine_recycles_a_dead_engines_pool_and_graphs_but_never_a_live_ones(models):
    """GPUBatching keeps one spare pool per geometry: the next engine (serve benchmarks build one per run)
    takes its device memory and decode graphs once the last engine is gone, and decodes as well with them;
    an engine still alive keeps its pool to itself."""
    import gc
    cpu, gpu = models["gqa"]
    llm = LLM(gpu.config, gpu)
    first = Engine(llm, num_blocks=16, block_size=4)
    first.generate(prompts()[:3], max_tokens=4)
    k, buckets = first.pool.k, set(first.runner.graphs)
    assert buckets
    del first
    gc.collect()
    second = Engine(llm, num_blocks=16, block_size=4)
    assert second.pool.k is k and set(second.runner.graphs) == buckets    # the dead engine's memory and graphs
    third = Engine(llm, num_blocks=16, block_size=4)
    assert third.pool.k is not k and not third.runner.graphs              # `second` still holds its pool
    second.runner.capture_buckets(6)                                     # a warm-up: every bucket up to 6 rows
    assert set(second.runner.graphs) == {1, 2, 4, 8} and second.runner.graph_error is None
    results = second.generate(prompts(), max_tokens=16)
    _assert_graphs_ran(second)
    assert_teacher_forced_greedy(cpu, prompts(), results)


@needs_gpu
@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 31), (64, 32000), (17, 49155), (5, 128256)])
def test_the_argmax_kernel_is_np_argmax_on_ties_and_nans(models, rows, vocab):
    """argmax_rows (kernels/sampling.cu) through DeviceOps.argmax: np.argmax of every row, ties, NaN-poisoned
    rows and all; the same ids on a second launch (deterministic); into a larger ids buffer, its rows only."""
    from minillm.cuda.forward import DeviceOps
    ops = DeviceOps(models["gqa"][1])
    x = tricky_logits(np.random.default_rng(rows), rows, vocab)
    d = cp.asarray(x)
    first, second = cp.asnumpy(ops.argmax(d)), cp.asnumpy(ops.argmax(d))
    assert first.dtype == np.int32 and first.tolist() == second.tolist() == np.argmax(x, axis=1).tolist()
    ids = cp.full(rows + 3, -7, cp.int32)
    ops.argmax(d, out=ids[:rows])
    assert cp.asnumpy(ids).tolist() == first.tolist() + [-7] * 3


@needs_gpu
@pytest.mark.parametrize("kv", ["float16", "int8"])
def test_gpu_forward_greedy_is_the_argmax_of_the_downloaded_logits(models, kv):
    """Two device runners over the same steps (a mixed one eager, then decodes by bucket graph, 3 padded to 4):
    the ids one copies back are the argmax of the logits the other copies back, exactly."""
    cpu, gpu = models["gqa"]
    ids_runner, logits_runner = (GPUBatchedRunner(gpu, DevicePagedKV(cpu.config, 24, 4, kv), use_graph=True)
                                 for _ in range(2))
    prefill, decode, _ = schedule_by_hand(4, 24)
    ta, tb = prefill[0].block_table, prefill[1].block_table
    for step in [prefill, [SeqChunk([11], 20, ta), SeqChunk([12], 7, tb), SeqChunk([13], 3, tb)],
                 [SeqChunk([14], 21, ta)]]:
        ids, logits = ids_runner.forward_greedy(step), logits_runner.forward(step)
        assert ids.dtype == np.int32 and ids.tolist() == logits.argmax(axis=1).tolist()
    assert ids_runner.graph_error is None and sorted(ids_runner.graphs) == [1, 4]


@needs_gpu
@pytest.mark.parametrize("kind,options", [("mistral", dict()),
                                          ("gqa", dict(num_blocks=16, block_size=4, kv_cache="int8"))],
                         ids=["mistral", "gqa-int8-tiny-pool"])
def test_gpu_engine_greedy_tokens_by_ids_equal_the_logits_path(models, kind, options):
    """The engine on the device, greedy: ids picked on the device (the default) and logits copied back and
    argmaxed on the host (device_greedy=False) give the same token streams, graphs and preemption included."""
    cpu, gpu = models[kind]
    llm = LLM(gpu.config, gpu)
    on = Engine(llm, **options)
    called = []
    forward_greedy = on.runner.forward_greedy
    on.runner.forward_greedy = lambda chunks: called.append(len(chunks)) or forward_greedy(chunks)
    got = on.generate(prompts(), max_tokens=16)
    want = Engine(llm, device_greedy=False, **options).generate(prompts(), max_tokens=16)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert called and [len(r.token_ids) for r in got] == [16] * len(LENGTHS)
    if "num_blocks" in options:
        assert on.stats()["preemptions"] > 0
    _assert_graphs_ran(on)
    assert_teacher_forced_greedy(cpu.with_options(kv_cache=options.get("kv_cache", "auto")), prompts(), got)


class FakeStream:
    """begin_capture / end_capture recorded; end_capture returns a graph whose launches are counted."""
    def __init__(self, fail_end: bool = False):
        self.events, self.fail_end = [], fail_end

    def begin_capture(self):
        self.events.append("begin")

    def end_capture(self):
        self.events.append("end")
        if self.fail_end:
            raise RuntimeError("capture invalidated")
        stream = self

        class Graph:
            def launch(self, on):
                stream.events.append(("launch", on is stream))
        return Graph()


def _capturing_model(monkeypatch, stream, prepare=None):
    """A GPUTransformer shell (no GPU) whose capture_with_cublas runs against a fake stream and cuBLAS."""
    from types import SimpleNamespace
    from minillm.cuda import cublas_raw, gpu_model
    handles = []
    monkeypatch.setattr(gpu_model, "_cp", lambda: SimpleNamespace(
        cuda=SimpleNamespace(device=SimpleNamespace(get_cublas_handle=lambda: 7))))
    monkeypatch.setattr(cublas_raw, "prepare", prepare or handles.append)
    m = gpu_model.GPUTransformer.__new__(gpu_model.GPUTransformer)
    m.stream, m._capturing = stream, False
    return m, handles


def test_capture_with_cublas_routes_gemms_to_cublas_raw_only_while_capturing(monkeypatch):
    stream = FakeStream()
    m, handles = _capturing_model(monkeypatch, stream)
    seen = []
    graph, result, error = m.capture_with_cublas(lambda: seen.append(m._capturing) or 42)
    assert (result, error, seen, handles, m._capturing) == (42, None, [True], [7], False)
    assert stream.events == ["begin", "end"] and graph is not None


@pytest.mark.parametrize("fail", ["step", "end", "prepare"])
def test_capture_with_cublas_reports_why_it_failed(monkeypatch, fail):
    def refuse(handle):
        raise OSError("no libcublas")
    stream = FakeStream(fail_end=fail == "end")
    m, _ = _capturing_model(monkeypatch, stream, refuse if fail == "prepare" else None)

    def step():
        if fail == "step":
            raise RuntimeError("boom")
    graph, result, error = m.capture_with_cublas(step)
    assert graph is None and result is None and m._capturing is False
    assert error == {"step": "RuntimeError: boom", "end": "RuntimeError: capture invalidated",
                     "prepare": "OSError: no libcublas"}[fail]
    assert stream.events == ([] if fail == "prepare" else ["begin", "end"])      # a capture begun always ends


def test_the_batching_graphs_replay_what_the_model_captured(monkeypatch):
    from minillm.cuda.forward import DeviceOps
    stream = FakeStream()
    m, _ = _capturing_model(monkeypatch, stream)
    ops = DeviceOps.__new__(DeviceOps)
    ops.model = m
    replay, error = ops.capture(lambda: "logits")
    assert error is None and replay() == "logits" and stream.events == ["begin", "end", ("launch", True)]
    m2, _ = _capturing_model(monkeypatch, FakeStream(fail_end=True))
    ops.model = m2
    assert ops.capture(lambda: None) == (None, "RuntimeError: capture invalidated")
