"""BLAS threads chosen by measuring (issue 16): fewer where more are slower, more where they pay,
--threads and the user's environment win, each phase runs at its count, and no count changes a result."""
import numpy as np
import pytest
from click.testing import CliRunner

from hf_models import llama_config, save_random_model
from minillm import threads
from minillm.errors import MiniLLMError


@pytest.fixture(autouse=True)
def fresh_thread_state(monkeypatch):
    """Each test starts with no policy, no --threads and no user limit in the environment; BLAS is
    put back as it was (threads.py keeps process-wide state, as BLAS itself does)."""
    for var in threads.USER_LIMIT_VARS:
        monkeypatch.delenv(var, raising=False)
    saved, count = dict(threads._state), threads.blas_threads()
    threads._state.update(policy=None, user_threads=None)
    yield
    threads._state.update(saved)
    threads._state["count"] = None
    threads.set_blas_threads(count)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Big enough that OpenBLAS really splits its matmuls over 2 threads (its gemv threads past 9216
    elements, its gemm past 2**18 multiply-adds), small enough to run in a second."""
    path = tmp_path_factory.mktemp("threads-model")
    save_random_model(llama_config(vocab_size=2048, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2), path)
    return path


@pytest.fixture
def fake_step(monkeypatch):
    """-> make(seconds_at): a `step(rows)` that "takes" seconds_at(blas count, rows) on a fake clock, so
    what choose sees is exactly what a machine would show, without timing noise from this one."""
    clock = [0.0]
    monkeypatch.setattr(threads.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(threads, "cores", lambda: 2)

    def make(seconds_at):
        def step(rows):
            clock[0] += seconds_at(threads.blas_threads(), rows)
        return step
    return make


def test_two_threads_slower_than_one_choose_one(fake_step):
    """The busy 2-core machine: a neighbour makes the second BLAS thread cost more than it gives."""
    policy = threads.choose(fake_step(lambda n, rows: 0.001 if n == 1 else 0.015))
    assert (policy.decode, policy.prefill) == (1, 1)
    assert "measured" in policy.reason and "1t 1.00 ms vs 2t 15.00 ms" in policy.reason


def test_threads_that_pay_are_taken_per_phase(fake_step):
    """Idle cores: prefill (compute-bound) gains from 2 threads; a decode that gains under 10% stays on 1."""
    cost = lambda n, rows: (0.001 if n == 1 else 0.00095) if rows == 1 else (0.006 if n == 1 else 0.003)
    policy = threads.choose(fake_step(cost))
    assert (policy.decode, policy.prefill) == (1, 2)
    assert policy.count(1) == 1 and policy.count(threads.DECODE_ROWS) == 1 and policy.count(100) == 2


def test_the_flag_and_the_environment_win_over_measuring(monkeypatch):
    never = lambda rows: pytest.fail("measured although the count was given")
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    assert threads.choose(never) == threads.ThreadPolicy(1, 1, "$OPENBLAS_NUM_THREADS=1")
    assert threads.choose(never, threads=2) == threads.ThreadPolicy(2, 2, "--threads 2")
    assert threads.n_threads() == 2                     # the pool follows --threads too
    with pytest.raises(MiniLLMError):
        threads.choose(never, threads=0)


def test_each_phase_runs_at_its_count(model_dir, monkeypatch):
    import minillm
    llm = minillm.load(str(model_dir), threads=1)
    seen = []
    real = threads.set_blas_threads
    monkeypatch.setattr(threads, "set_blas_threads", lambda n: (seen.append(n), real(n)))
    threads.install(threads.ThreadPolicy(decode=1, prefill=2, reason="test"))
    seen.clear()
    from minillm.engine.generate import generate_ids
    from minillm.engine.sampling import SamplingParams
    generate_ids(llm.model, list(range(1, 40)), 4, SamplingParams())
    assert seen == [2, 1]                               # prefill of 39 rows on 2, then decode on 1


def _run_at(count, model_dir):
    """Greedy tokens and their logits, seeded samples, and an int4 calibration, all at `count` threads."""
    import minillm
    from minillm.checkpoints.quantize import quantize_checkpoint
    from minillm.checkpoints.weights import load_hf_dir

    llm = minillm.load(str(model_dir), threads=count)
    assert threads.blas_threads() == count
    prompt = list(range(3, 70))                         # a prefill of 67 rows: a threaded gemm
    logits = llm.logits(prompt)
    greedy = llm.model.prefill(prompt, llm.model.new_cache(80))
    from minillm.engine.generate import generate_ids
    from minillm.engine.sampling import SamplingParams
    tokens = generate_ids(llm.model, prompt, 8, SamplingParams()).token_ids
    sampled = generate_ids(llm.model, prompt, 8, SamplingParams(temperature=1.0, seed=7)).token_ids
    config, tensors = load_hf_dir(model_dir)
    _, quantized = quantize_checkpoint(config, tensors, "int4", 32, calibration_tokens=256)
    return logits, greedy, tokens, sampled, quantized


def _blas_rounds_by_count() -> bool:
    """Whether this BLAS rounds a prefill-sized fp32 matmul otherwise on 2 threads than on 1. OpenBLAS 0.3.31's
    SkylakeX kernels did not (issue 16's machine); its Haswell kernels, as it picks them on an AMD EPYC VM, do
    in the last bits."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal(shape).astype(np.float32) for shape in ((67, 128), (128, 512)))
    before = threads.blas_threads()
    try:
        threads.set_blas_threads(1)
        one = a @ b
        threads.set_blas_threads(2)
        two = a @ b
    finally:
        threads.set_blas_threads(before)
    return not np.array_equal(one, two)


def test_no_count_changes_a_result(model_dir):
    """Bit for bit where the BLAS itself rounds the same at any count; else within fp32 rounding."""
    one, two = _run_at(1, model_dir), _run_at(2, model_dir)
    if _blas_rounds_by_count():
        for got, want in ((two[0], one[0]), (two[1], one[1])):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        return
    assert np.array_equal(one[0], two[0]) and np.array_equal(one[1], two[1])      # bit for bit
    assert one[2] == two[2] and one[3] == two[3]
    assert one[4].keys() == two[4].keys()
    for name in one[4]:
        assert np.array_equal(one[4][name], two[4][name]), name


def test_bench_prints_the_policy_and_the_flag_sets_it(model_dir):
    from minillm.cli import cli
    result = CliRunner().invoke(cli, ["bench", "-m", str(model_dir), "--prompt-tokens", "16", "--new-tokens", "4",
                                      "--repeats", "1", "--no-peer"])
    assert result.exit_code == 0, result.output
    assert f"threads: {threads.policy()}" in result.output and "BLAS threads: decode" in result.output
    # --threads reaches load(): a bench past the context stops right after loading, policy installed
    CliRunner().invoke(cli, ["bench", "-m", str(model_dir), "--threads", "1", "--prompt-tokens", "9999", "--no-peer"])
    assert threads.policy() == threads.ThreadPolicy(1, 1, "--threads 1") and threads.blas_threads() == 1
