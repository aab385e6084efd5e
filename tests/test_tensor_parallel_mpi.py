"""Tensor parallelism across processes: 2 MPI ranks started by the real launcher (mpiexec) on loopback.

Small on purpose (CI has 2 cores and ranks poll while they wait): tiny random models, a few tokens, and
every run bounded by a timeout so a hang fails the test instead of stalling CI."""
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from contextlib import contextmanager, suppress
from pathlib import Path

import numpy as np
import pytest

import minillm
from hf_models import llama_config, save_random_model

pytest.importorskip("mpi4py")


def _mpiexec():
    from minillm.engine.parallel.launcher import find_mpiexec
    from minillm.errors import MiniLLMError
    try:
        return find_mpiexec()              # beside this Python (the mpich wheel's), else on PATH
    except MiniLLMError:
        return None


MPIEXEC = _mpiexec()
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec (pip install mpich)")
IDS = [3, 17, 99, 250, 5, 7]
ENV = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")


def mpirun(script: str, *args, n=2, timeout=60, env=None):
    """`mpiexec -n N python -c script args`, bounded in time."""
    cmd = [MPIEXEC, "-n", str(n), sys.executable, "-c", textwrap.dedent(script), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or ENV)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp-mpi")
    save_random_model(llama_config(n_heads=8, n_kv_heads=2), path)
    return path


def test_logits_at_tp2_over_mpi_equal_tp1(model_dir, tmp_path):
    out = tmp_path / "logits.npy"
    result = mpirun("""
        import sys, numpy as np, minillm
        llm = minillm.load(sys.argv[1], tp=2)
        logits = llm.logits([3, 17, 99, 250, 5, 7])
        if llm.model.comm.rank == 0:
            np.save(sys.argv[2], logits)
    """, model_dir, out)
    assert result.returncode == 0, result.stderr
    one = minillm.load(model_dir).logits(IDS)
    assert np.abs(np.load(out) - one).max() < 1e-4


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory, smollm2_dir):
    """A random 2-layer model with SmolLM2's vocabulary and tokenizer: text in, text out, fast."""
    from minillm.checkpoints.tokenizer_files import save_hf, tokenizer_from_hf
    path = tmp_path_factory.mktemp("tiny-tp")
    save_random_model(llama_config(vocab_size=49152, num_hidden_layers=2, max_position_embeddings=4096), path)
    save_hf(tokenizer_from_hf(smollm2_dir), path)
    return path


def test_generate_with_tp2_prints_what_tp1_prints(tiny_chat_model):
    cmd = [sys.executable, "-m", "minillm", "generate", "-m", str(tiny_chat_model), "--no-chat", "-n", "8",
           "Once upon a time", "--tp", "2"]
    two = subprocess.run(cmd, capture_output=True, text=True, timeout=90, env=ENV)
    assert two.returncode == 0, two.stderr
    want = minillm.load(tiny_chat_model).generate("Once upon a time", max_tokens=8, chat=False).text
    assert two.stdout == want + "\n" and len(want.strip()) > 0
    assert "[tp 2 · weights per rank" in two.stderr           # rank 0 reports what each rank holds
    assert two.stderr.count("decode") == 1                    # the other rank prints nothing


def test_a_shape_tp_cannot_split_is_one_line_from_every_rank(model_dir):
    cmd = [sys.executable, "-m", "minillm", "generate", "-m", str(model_dir), "--tp", "3", "hi"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=ENV)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode != 0
    assert len(lines) == 1 and lines[0].startswith("minillm: error: tp=3 does not divide"), result.stderr


KILL_MID_GENERATION = """
    import os, signal, sys, time, numpy as np, minillm
    from minillm.engine.generate import generate_ids
    from minillm.engine.sampling import SamplingParams
    llm = minillm.load(sys.argv[1], tp=2)
    rank, how = llm.model.comm.rank, sys.argv[2]
    decode = llm.model.decode
    steps = []
    def dying_decode(token, cache):
        steps.append(token)
        if rank == 1 and len(steps) == 3:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)     # the rank dies outright
            time.sleep(3600)                              # or hangs: only the others' timeout sees it
        return decode(token, cache)
    llm.model.decode = dying_decode
    generate_ids(llm.model, [3, 17, 99], 50, SamplingParams(temperature=0.0))
    print("finished")
"""


@pytest.mark.parametrize("how", ["kill", "hang"])
def test_a_rank_that_dies_mid_generation_ends_the_others(model_dir, how):
    start = time.perf_counter()
    result = mpirun(KILL_MID_GENERATION, model_dir, how, timeout=60, env=dict(ENV, MINILLM_TP_TIMEOUT="2"))
    assert result.returncode != 0
    assert "finished" not in result.stdout
    assert time.perf_counter() - start < 30
    if how == "hang":                                     # rank 0 says why it stopped
        assert "waited over 2 s for the other ranks" in result.stderr


def test_chat_with_tp2_answers_what_tp1_answers(tiny_chat_model):
    cmd = [sys.executable, "-m", "minillm", "chat", "-m", str(tiny_chat_model), "-n", "6", "--tp", "2"]
    two = subprocess.run(cmd, input="Hello there\n\n", capture_output=True, text=True, timeout=90, env=ENV)
    assert two.returncode == 0, two.stderr
    want = minillm.load(tiny_chat_model).generate([{"role": "user", "content": "Hello there"}], max_tokens=6).text
    assert two.stdout == f"> {want}\n> "                   # rank 0 read both lines for every rank


def test_bench_tp2_measures_both_runs(model_dir):
    cmd = [sys.executable, "-m", "minillm", "bench", "-m", str(model_dir), "--tp", "2", "--prompt-tokens", "8",
           "--new-tokens", "3"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=90, env=ENV)
    assert result.returncode == 0, result.stderr
    assert "tp=1, 2 threads" in result.stdout and "tp=2, 1 thread a rank" in result.stdout
    assert "one all-reduce alone: 64 values" in result.stdout          # dim = 64


# ---- `minillm serve --tp 2`: every process of the launch ends with the launcher ----------------------
TAG_VAR = "MINILLM_TEST_LAUNCH"      # set for one launch; hydra passes the environment on to the ranks


def launch_processes(tag: str) -> dict[int, str | None]:
    """The live processes of one launch (launcher, mpiexec, hydra's proxy, the ranks) -> pid: its PMI_RANK,
    None for all but the ranks. Found by environment in /proc: hydra starts each rank in a session of its
    own, so neither the process tree nor a process group reaches them once the launcher is gone."""
    marker = f"{TAG_VAR}={tag}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            env = (entry / "environ").read_bytes().split(b"\0") if entry.name.isdigit() else []
        except OSError:                     # ended meanwhile (a zombie reads as empty: gone too)
            continue
        if marker in env:
            found[int(entry.name)] = next((v.split(b"=")[1].decode() for v in env if v.startswith(b"PMI_RANK=")), None)
    return found


def launch_left_after(tag: str, seconds: float) -> dict[int, str | None]:
    """What of the launch is still alive once all of it ended, or `seconds` passed (a bound, not a timing)."""
    deadline = time.monotonic() + seconds
    while (left := launch_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def kill_launch(launcher: subprocess.Popen, tag: str) -> None:
    """Kill whatever of a launch is left, so that no rank outlives a failed test: the launcher's process
    group (itself and mpiexec), then the ranks, which hydra starts in sessions of their own."""
    with suppress(ProcessLookupError):
        os.killpg(launcher.pid, signal.SIGKILL)
    for pid in launch_processes(tag):
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    launcher.wait()


@contextmanager
def tp_server(model_dir, tmp_path):
    """`minillm serve --tp 2` answering on a free port -> (the launcher, its URL, the launch's tag). However
    the test ends, every process of the launch is killed afterwards: none may outlive a failed test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tag, url, log = uuid.uuid4().hex, f"http://127.0.0.1:{port}", tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "minillm", "serve", "-m", str(model_dir), "--tp", "2", "--port", str(port)]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("w"), env=dict(ENV, **{TAG_VAR: tag}),
                              start_new_session=True)
    try:
        import httpx
        deadline = time.monotonic() + 60
        while server.poll() is None and time.monotonic() < deadline:
            with suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            time.sleep(0.3)
        else:
            pytest.fail(f"serve --tp 2 did not answer /health: {log.read_text()}")
        yield server, url, tag
    finally:
        kill_launch(server, tag)


def test_serve_with_tp2_answers_like_generate_and_ctrl_c_ends_every_rank(tiny_chat_model, tmp_path):
    import httpx
    with tp_server(tiny_chat_model, tmp_path) as (server, url, tag):
        body = {"model": str(tiny_chat_model), "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()
        want = minillm.load(tiny_chat_model).generate("Once upon a time", max_tokens=6, chat=False).text
        assert answer["choices"][0]["text"] == want
        assert sorted(filter(None, launch_processes(tag).values())) == ["0", "1"]
        server.send_signal(signal.SIGINT)               # Ctrl-C to the launcher alone
        assert launch_left_after(tag, 5) == {}
        assert server.wait(timeout=5) in (0, 130)


@pytest.mark.parametrize("how, within_s", [(signal.SIGTERM, 5), (signal.SIGKILL, 10)], ids=["sigterm", "sigkill"])
def test_serve_tp2_ranks_end_when_the_launcher_is_stopped_or_killed(tiny_chat_model, tmp_path, how, within_s):
    """SIGTERM: the launcher passes it on, rank 0 drains and stops the other, and all exit cleanly. SIGKILL:
    the launcher can pass nothing on; each rank sees it gone and exits (an orphaned rank 0 would go on
    answering requests)."""
    with tp_server(tiny_chat_model, tmp_path) as (server, url, tag):
        assert sorted(filter(None, launch_processes(tag).values())) == ["0", "1"]
        server.send_signal(how)
        assert launch_left_after(tag, within_s) == {}
        if how == signal.SIGTERM:
            assert server.wait(timeout=5) == 0          # drained and stopped, not killed


def test_ctrl_c_ends_every_rank_with_one_line(tiny_chat_model):
    """Ctrl-C in a terminal signals the foreground process group: the launcher and mpiexec, which passes it
    on to the ranks."""
    cmd = [sys.executable, "-m", "minillm", "generate", "-m", str(tiny_chat_model), "--tp", "2", "--no-chat", "-n",
           "4000", "Hi"]
    tag = uuid.uuid4().hex
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(ENV, **{TAG_VAR: tag}), start_new_session=True)
    try:
        lines = [proc.stderr.readline()]
        while lines[-1] and "[tp 2" not in lines[-1]:            # loaded on both ranks: generating now
            lines.append(proc.stderr.readline())
        time.sleep(0.5)
        start = time.perf_counter()
        os.killpg(proc.pid, signal.SIGINT)
        rest = proc.communicate(timeout=30)[1]
    finally:
        kill_launch(proc, tag)
    assert proc.returncode == 130 and time.perf_counter() - start < 10
    errors = [line for line in rest.splitlines() if line.strip()]
    assert errors and all(line.startswith("minillm: error:") for line in errors) and "Traceback" not in rest, rest
