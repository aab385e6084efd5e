"""Tensor parallelism in one process: ranks as threads (LocalGroup), the sharding rules, the refusals,
and the NCCL communicator's code over a stand-in for cupy.cuda.nccl. The real multi-process runs
(mpiexec, the CLI, a rank that dies) are in test_tensor_parallel_mpi.py."""
import ctypes
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

import minillm
from minillm.engine.generate import generate_ids
from minillm.engine.parallel import sharding
from minillm.engine.parallel.communicator import (CommTimeout, LocalGroup, NCCLCommunicator, SingleProcess,
                                                  parallel_communicator, run_ranks, shared_seed)
from minillm.engine.sampling import SamplingParams
from minillm.errors import MiniLLMError
from minillm.model.config import ModelConfig
from hf_models import hf_logits, llama_config, mistral_config, qwen2_config, save_random_model

IDS = [3, 17, 99, 250, 5, 7, 300, 42]

CASES = {   # name: (HF config, tp)
    "qwen2-qkv-bias-tp2": (qwen2_config(), 2),
    "llama-o-and-mlp-bias-tp2": (llama_config(attention_bias=True, mlp_bias=True), 2),
    "gqa-tp2": (llama_config(n_heads=8, n_kv_heads=2), 2),
    "gqa-tp4-kv-replicated": (llama_config(n_heads=8, n_kv_heads=2), 4),
    "mqa-tp2": (llama_config(n_heads=8, n_kv_heads=1), 2),
    "mha-tp4-tied": (llama_config(n_heads=4, n_kv_heads=4, tied=True), 4),
    "gqa-tp3-uneven-vocab": (llama_config(n_heads=6, n_kv_heads=3, hidden_size=48, intermediate_size=96), 3),
    "mistral-window-tp2": (mistral_config(sliding_window=4), 2),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    config, tp = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = save_random_model(config, path)
    return path, tp, hf_logits(hf, IDS)


def sharded(path, tp, fn, **load_options):
    """fn(llm) on every rank of a tp-way model loaded from path; -> the ranks' results."""
    return run_ranks(tp, lambda comm: fn(minillm.load(path, comm=comm, **load_options)))


def test_logits_at_tp_equal_tp1_and_hf(case):
    path, tp, hf = case
    one = minillm.load(path).logits(IDS)
    assert np.abs(one - hf).max() < 1e-4
    for logits in sharded(path, tp, lambda llm: llm.logits(IDS)):
        assert logits.shape == one.shape
        assert np.abs(logits - one).max() < 1e-4


def test_greedy_tokens_at_tp_equal_tp1(case):
    path, tp, _ = case

    def tokens(llm):
        g = generate_ids(llm.model, IDS[:4], 12, SamplingParams(temperature=0.0))
        return g.token_ids

    one = minillm.load(path)
    want = tokens(one)
    for got in sharded(path, tp, tokens):
        if got != want:     # allowed only at a near-tie: the first differing step's top-2 gap is tiny
            step = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            logits = one.logits(IDS[:4] + want[:step])[-1]
            top2 = np.sort(logits)[-2:]
            assert top2[1] - top2[0] < 1e-3, (got, want)


def test_every_rank_samples_the_same_tokens_without_a_seed(tmp_path):
    save_random_model(llama_config(), tmp_path)

    def sample(llm):
        seed = shared_seed(llm.model.comm, None)
        return generate_ids(llm.model, IDS[:3], 10, SamplingParams(temperature=1.0, seed=seed)).token_ids

    a, b = sharded(tmp_path, 2, sample)
    assert a == b


@pytest.fixture(scope="module", params=[("int8", 128), ("int4", 32)], ids=["int8", "int4-g32"])
def quantized_dir(request, tmp_path_factory):
    """A random model quantized once and saved that way: each rank then maps only its shard of it."""
    from minillm.checkpoints.weights import save_hf_dir
    from minillm.model.quant import QuantizedWeight
    quant, group_size = request.param
    src, dst = tmp_path_factory.mktemp("float"), tmp_path_factory.mktemp(quant)
    save_random_model(llama_config(intermediate_size=128), src)
    model = minillm.load(src, quant=quant, group_size=group_size).model
    tensors = {}
    for name, w in model.hf_tensors().items():
        tensors |= w.tensors(name.removesuffix(".weight")) if isinstance(w, QuantizedWeight) else {name: w}
    save_hf_dir(dst, model.config, tensors)
    return dst


def test_quantized_shards_equal_the_unsharded_quantized_model(quantized_dir):
    one = minillm.load(quantized_dir).logits(IDS)
    for logits in sharded(quantized_dir, 2, lambda llm: llm.logits(IDS)):
        assert np.abs(logits - one).max() < 1e-4


def test_16_bit_shards_equal_the_unsharded_16_bit_model(tmp_path):
    save_random_model(llama_config(), tmp_path)
    one = minillm.load(tmp_path, dtype="bfloat16").logits(IDS)
    for logits in sharded(tmp_path, 2, lambda llm: llm.logits(IDS), dtype="bfloat16"):
        assert np.abs(logits - one).max() < 1e-4


def test_flashnorm_shards_equal_the_unsharded_flashnorm_model(tmp_path):
    save_random_model(llama_config(), tmp_path)
    one = minillm.load(tmp_path, flashnorm=True).logits(IDS)
    for logits in sharded(tmp_path, 2, lambda llm: llm.logits(IDS), flashnorm=True):
        assert np.abs(logits - one).max() < 1e-4


def test_each_rank_holds_its_share_of_the_weights(tmp_path):
    """Per-rank bytes sum to the unsharded model's, plus what is replicated (norms, KV heads at tp > n_kv)
    and the vocab padding; each rank's share is near 1/tp."""
    cfg = llama_config(n_heads=8, n_kv_heads=2)
    save_random_model(cfg, tmp_path)
    whole = sharding.model_bytes(minillm.load(tmp_path).model)
    tp, dim, hd, layers = 4, 64, 8, 3
    per_rank = sharded(tmp_path, tp, lambda llm: sharding.model_bytes(llm.model))
    norms = (2 * layers + 1) * dim * 4                           # replicated on every rank
    kv_copies = layers * 2 * hd * dim * 4 * (tp - 2)             # 2 KV heads over 4 ranks: each held twice
    assert sum(per_rank) == whole + (tp - 1) * norms + kv_copies
    assert max(per_rank) < 0.35 * whole


def test_int4_row_parallel_shards_keep_whole_groups(quantized_dir):
    local = run_ranks(2, lambda comm: minillm.load(quantized_dir, comm=comm).model)
    o, down = local[1].layers[0].wo, local[1].layers[0].w_down
    if not hasattr(o, "group_size"):
        pytest.skip("int8: one scale per row, nothing to split")
    assert (o.shape, o.group_size, o.scales.shape) == ((64, 32), 32, (64, 1))        # 4 heads × 8 of 8 × 8
    assert (down.shape, down.group_size, down.scales.shape) == ((64, 64), 32, (64, 2))    # 64 of 128


def test_the_engine_at_tp2_gives_the_tokens_of_tp1(tmp_path):
    """Rank 0 runs the Engine (scheduler, sampler); rank 1 follows the batches it broadcasts."""
    from minillm.engine.engine import Engine
    from minillm.engine.parallel.serving import follow
    save_random_model(llama_config(), tmp_path)
    prompts = [[3, 17, 99], [5, 7, 300, 42, 11], [250, 1]]
    want = [g.token_ids for g in Engine(minillm.load(tmp_path), max_kv_bytes=1 << 20).generate(prompts, max_tokens=6)]

    def rank(comm):
        llm = minillm.load(tmp_path, comm=comm)
        if comm.rank != 0:
            return follow(llm)
        engine = Engine(llm, max_kv_bytes=1 << 20)
        out = [g.token_ids for g in engine.generate(prompts, max_tokens=6)]
        engine.runner.release()
        return out

    got, follower_steps = run_ranks(2, rank)
    assert got == want and follower_steps >= 6


# ---- refusals ----------------------------------------------------------------------------------
SMOLLM2 = ModelConfig(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536)


def test_a_shape_that_does_not_divide_is_refused_naming_the_sizes_that_work():
    with pytest.raises(MiniLLMError, match=r"tp=2 does not divide .*9 query heads and 3 KV heads.*tp can be 1, 3$"):
        sharding.check(SMOLLM2, 2)
    sharding.check(SMOLLM2, 3)


def test_int4_groups_that_a_row_parallel_shard_would_split_are_refused():
    g128 = SMOLLM2.replace(quantization={"method": "int4", "group_size": 128})
    with pytest.raises(MiniLLMError, match="192 inputs of o_proj.*groups of 128.*group size 32 or 64"):
        sharding.check(g128, 3)
    sharding.check(g128.replace(quantization={"method": "int4", "group_size": 64}), 3)


def test_load_refuses_in_one_line(tmp_path):
    save_random_model(llama_config(n_heads=8, n_kv_heads=2), tmp_path)
    with pytest.raises(MiniLLMError, match="tp=3 does not divide"):
        run_ranks(3, lambda comm: minillm.load(tmp_path, comm=comm))
    with pytest.raises(MiniLLMError, match="started by mpiexec"):
        minillm.load(tmp_path, tp=2)                          # not a rank of 2: says how to start them
    with pytest.raises(MiniLLMError, match="communicator given has 2 ranks"):
        run_ranks(2, lambda comm: parallel_communicator(3, comm))


# ---- the communicators -------------------------------------------------------------------------
def collectives(comm):
    x = np.full(3, comm.rank + 1.0, dtype=np.float32)
    summed = comm.all_reduce(x.copy())
    gathered = comm.all_gather(x)
    root = comm.broadcast(np.full(2, comm.rank, dtype=np.float32), root=1)
    obj = comm.broadcast_object({"rank": comm.rank})
    comm.barrier()
    return np.asarray(summed).tolist(), np.asarray(gathered).tolist(), np.asarray(root).tolist(), obj


def test_local_group_collectives():
    results = run_ranks(3, collectives)
    for summed, gathered, root, obj in results:
        assert summed == [6.0] * 3
        assert gathered == [[1.0] * 3, [2.0] * 3, [3.0] * 3]
        assert root == [1.0, 1.0] and obj == {"rank": 0}
    assert collectives(SingleProcess()) == ([1.0] * 3, [[1.0] * 3], [0.0, 0.0], {"rank": 0})


def test_a_rank_that_fails_stops_the_others_instead_of_hanging():
    def work(comm):
        if comm.rank == 1:
            raise RuntimeError("rank 1 broke")
        comm.all_reduce(np.zeros(4, dtype=np.float32))       # would wait forever for rank 1

    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="rank 1 broke"):
        run_ranks(2, work, timeout_s=20)
    assert time.perf_counter() - start < 5


def test_a_missing_rank_times_out():
    group = LocalGroup(2, timeout_s=0.3)
    with pytest.raises(CommTimeout, match="waited over 0.3 s"):
        group.communicators()[0].all_reduce(np.zeros(2, dtype=np.float32))


class _DeviceArray(np.ndarray):
    """A NumPy array that answers `.data.ptr` like a CuPy one."""

    @property
    def data(self):
        return SimpleNamespace(ptr=self.ctypes.data)


class _FakeNCCL:
    """cupy.cuda.nccl's surface, over raw pointers between thread ranks (the real code path's calls)."""
    NCCL_FLOAT32, NCCL_FLOAT16, NCCL_INT64, NCCL_INT32, NCCL_UINT8, NCCL_SUM = 7, 6, 4, 2, 1, 0
    DTYPES = {7: np.float32, 6: np.float16, 4: np.int64, 2: np.int32, 1: np.uint8}
    groups: dict = {}
    lock = threading.Lock()

    @staticmethod
    def get_unique_id():
        return (123,)

    class NcclCommunicator:
        def __init__(self, size, unique_id, rank):
            with _FakeNCCL.lock:
                self.group = _FakeNCCL.groups.setdefault(unique_id, LocalGroup(size, timeout_s=10))
            self.rank = rank

        def _read(self, ptr, count, dtype):
            dtype = np.dtype(_FakeNCCL.DTYPES[dtype])
            raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(ptr)
            return np.frombuffer(raw, dtype=dtype)

        def allReduce(self, send, recv, count, dtype, op, stream):
            parts = self.group.exchange(self.rank, self._read(send, count, dtype).copy())
            self._read(recv, count, dtype)[:] = sum(parts[1:], parts[0])

        def allGather(self, send, recv, count, dtype, stream):
            parts = self.group.exchange(self.rank, self._read(send, count, dtype).copy())
            self._read(recv, count * len(parts), dtype)[:] = np.concatenate(parts)

        def broadcast(self, send, recv, count, dtype, root, stream):
            parts = self.group.exchange(self.rank, self._read(send, count, dtype).copy())
            self._read(recv, count, dtype)[:] = parts[root]

        def abort(self):
            self.group.abort()


def _fake_cupy():
    stream = SimpleNamespace(ptr=0, done=True)
    device = lambda a: a.view(_DeviceArray)                          # noqa: E731
    return SimpleNamespace(
        ascontiguousarray=lambda a: device(np.ascontiguousarray(a)),
        empty=lambda shape, dtype: device(np.empty(shape, dtype)),
        zeros=lambda shape, dtype: device(np.zeros(shape, dtype)),
        cuda=SimpleNamespace(get_current_stream=lambda: stream))


def test_nccl_communicator_collectives_over_a_stand_in_backend():
    _FakeNCCL.groups.clear()
    results = run_ranks(2, lambda host: collectives(NCCLCommunicator(host, nccl=_FakeNCCL, xp=_fake_cupy())))
    for summed, gathered, root, obj in results:
        assert summed == [3.0] * 3 and gathered == [[1.0] * 3, [2.0] * 3]
        assert root == [1.0, 1.0] and obj == {"rank": 0}


def test_the_model_runs_on_the_nccl_communicator(tmp_path):
    save_random_model(llama_config(), tmp_path)
    _FakeNCCL.groups.clear()
    one = minillm.load(tmp_path).logits(IDS)

    def logits(host):
        comm = NCCLCommunicator(host, nccl=_FakeNCCL, xp=_fake_cupy())
        return np.asarray(minillm.load(tmp_path, comm=comm).logits(IDS))

    for out in run_ranks(2, logits):
        assert np.abs(out - one).max() < 1e-4


def test_a_tp_shard_runs_as_the_device_model_over_nccl(tmp_path):
    """load(tp=, device="cuda")'s path: each rank's shard moved by cuda.device_model.to_device (here onto
    NumPy, the CPU's stand-in for CuPy) with the NCCL communicator doing the all-reduces."""
    from minillm.cuda.device_model import to_device
    save_random_model(llama_config(), tmp_path)
    _FakeNCCL.groups.clear()
    one = minillm.load(tmp_path).logits(IDS)

    def logits(host):
        comm = NCCLCommunicator(host, nccl=_FakeNCCL, xp=_fake_cupy())
        model = to_device(minillm.load(tmp_path, comm=comm).model, "float32", xp=np, cache_dtype="float32")
        assert model.comm is comm
        return model.prefill(IDS, model.new_cache(len(IDS)), all_logits=True)

    for out in run_ranks(2, logits):
        assert np.abs(out - one).max() < 1e-4


def test_nccl_communicator_refuses_a_dtype_nccl_lacks():
    _FakeNCCL.groups.clear()
    with pytest.raises(MiniLLMError, match="not float64"):
        run_ranks(1, lambda host: NCCLCommunicator(host, nccl=_FakeNCCL, xp=_fake_cupy()).all_reduce(np.zeros(2)))


def test_stats_count_each_collective():
    def work(comm):
        for _ in range(3):
            comm.all_reduce(np.zeros(8, dtype=np.float32))
        comm.all_gather(np.zeros(4, dtype=np.float32))
        return comm.stats

    stats = run_ranks(2, work)[0]
    assert stats.calls["all_reduce"] == 3 and stats.bytes["all_reduce"] == 3 * 32
    assert stats.calls["all_gather"] == 1 and "all_reduce 3×" in stats.summary()


def test_smollm2_logits_at_tp3_equal_tp1(smollm2_dir):
    """The real weights (all-reduce changes the summation order): the shards cut from the loaded model."""
    from minillm.model.transformer import Transformer
    ids = [1, 504, 3458, 282, 4649, 314]
    llm = minillm.load(smollm2_dir)
    one, tensors = llm.logits(ids), llm.model.hf_tensors()

    def logits(comm):
        model = Transformer(*sharding.shard_checkpoint(llm.config, tensors, comm.rank, comm.size), comm=comm)
        return model.prefill(ids, model.new_cache(len(ids)), all_logits=True)

    for out in run_ranks(3, logits):
        assert np.abs(out - one).max() < 1e-3


# ---- the cost model, against hand-computed cases -------------------------------------------------
def test_allreduce_time_is_latency_plus_the_ring_bytes():
    from minillm.engine.parallel import cost
    link = cost.Link("test", bandwidth=1e9, latency_s=1e-5, source="made up")
    assert cost.allreduce_s(1e6, 1, link) == 0.0
    assert cost.allreduce_s(1e6, 2, link) == pytest.approx(1e-5 + 1e-3)          # 2(N-1)/N = 1 at N = 2
    assert cost.allreduce_s(1e6, 4, link) == pytest.approx(1e-5 + 1.5e-3)        # 2·3/4 = 1.5


def test_tp_rows_by_hand():
    from minillm.engine.parallel import cost
    cfg = ModelConfig(vocab_size=1000, dim=100, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=400)
    link = cost.Link("test", bandwidth=1e9, latency_s=1e-5, source="made up")
    one, two, four = cost.tp_rows(cfg, hbm_bandwidth=1e12, link=link, tps=(1, 2, 4), context=0)
    assert one.step_s == pytest.approx(cfg.n_params * 2 / 1e12) and one.comm_s == 0
    assert two.weight_bytes_per_rank == pytest.approx(cfg.n_params)             # 2 bytes a weight over 2
    assert two.comm_s == pytest.approx(2 * 2 * (1e-5 + 200 / 1e9))              # 2 layers × 2 all-reduces of 200 B
    assert two.bytes_moved_per_token_per_layer == pytest.approx(2 * 200)
    assert four.kv_bytes_per_token_per_rank == 2 * 2 * 1 * 25 * 2                # 2 KV heads over 4: one each
    assert cost.stops_paying([one, two, four]) == 2                            # latency dwarfs 0.6 µs of weights
    assert cost.pp_bubble(4, 12) == pytest.approx(3 / 15)
    link_fit = cost.measured_link(10.0, 1000, 110.0, 26000)
    assert link_fit.latency_s == pytest.approx(1e-5) and link_fit.bandwidth == pytest.approx(1e9)


def test_weight_formats_it_cannot_slice_are_refused():
    with pytest.raises(MiniLLMError, match="not nf4"):
        sharding.check(SMOLLM2.replace(quantization={"method": "nf4", "group_size": 64}), 3)


def test_plan_tp_prints_per_rank_memory_and_the_bubble():
    from click.testing import CliRunner
    from minillm.cli import cli
    result = CliRunner().invoke(cli, ["plan", "-m", "mistral-7b", "--gpu", "h200", "--tp", "8", "--pp", "4"])
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line for line in result.output.splitlines() if line[:3].strip().isdigit()}
    assert rows["8"].split()[1] == "1.81"                  # 14.48 GB of bf16 weights over 8 ranks
    assert rows["2"].split()[5] == "16.4"                  # 2 all-reduces × 2(N-1)/N × 4096 × 2 bytes = 16.4 KB
    assert "leave 75% of the schedule idle" in result.output       # (4 - 1) / (1 + 4 - 1)
    odd = CliRunner().invoke(cli, ["plan", "-m", "smollm2-135m", "--tp", "2"])
    assert "tp=2 does not split this model; tp can be 1" in odd.output


def test_speculative_decoding_with_tp_is_refused(tmp_path):
    from minillm.engine.engine import Engine
    save_random_model(llama_config(), tmp_path)
    with pytest.raises(MiniLLMError, match="speculative decoding does not run with tensor parallelism"):
        run_ranks(2, lambda comm: Engine(minillm.load(tmp_path, comm=comm), speculative="ngram"))
