"""Files that lie about their sizes are refused from what they hold, before anything is sized by the lie.

A config.json claiming 2^31 layers (or a GGUF's block_count, or a tokenizer id of ten million) used to
build names, lists or vocabularies of that size first: the load hung while memory grew. Each is now
checked against the tensors and tokens present, so the refusal costs what the real file costs: the
tests hold the memory traced during the refusal under a small bound, and the CLI, run as a user runs it,
to one line on stderr (a hang would run into the subprocess's wait bound).
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

import minillm
from minillm.checkpoints.tokenizer_files import load_tokenizer
from minillm.errors import MiniLLMError
from test_weights import tiny_llama, write_llama_gguf

PEAK_BYTES = 8 * 2**20      # the tiny model's own files take well under this to read and check


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict[str, Path]:
    """The tiny Llama as a GGUF and as a converted HF dir."""
    from minillm.checkpoints.convert import convert
    root = tmp_path_factory.mktemp("good")
    write_llama_gguf(root / "tiny.gguf", tiny_llama())
    convert(root / "tiny.gguf", root / "dir", progress=False, dtype="float32")
    return {"dir": root / "dir", "gguf": root / "tiny.gguf"}


@pytest.fixture
def wait_bound():
    """A lie that still hangs fails the test after 30 s instead of hanging the suite (not a timing check:
    the refusal needs a fraction of that)."""
    def fail(*_):
        raise TimeoutError("still sizing something by the lie after 30 s")
    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _dir_with(good, tmp_path, config=None, tokenizer=None) -> Path:
    """A copy of the good dir with config.json fields replaced and/or tokenizer.json edited."""
    path = Path(shutil.copytree(good["dir"], tmp_path / "model"))
    if config:
        c = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(c | config))
    if tokenizer:
        t = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
        tokenizer(t)
        (path / "tokenizer.json").write_text(json.dumps(t), encoding="utf-8")
    return path


def _gguf_with_layers(good, tmp_path, n_layers: int) -> Path:
    model = tiny_llama()
    model.config.num_hidden_layers = n_layers      # written as block_count; the tensors stay 2 layers
    write_llama_gguf(tmp_path / "lying.gguf", model)
    return tmp_path / "lying.gguf"


def _token_at(token_id: int):
    def edit(t):
        t["added_tokens"].append({"id": token_id, "content": "<far>", "special": True, "single_word": False,
                                  "lstrip": False, "rstrip": False, "normalized": False})
    return edit


LIES = {   # case: (make the file, what the one line must name)
    "config-layers-2^31": (lambda g, p: _dir_with(g, p, {"num_hidden_layers": 2**31}), "num_hidden_layers=2147483648"),
    "config-layers-10^6": (lambda g, p: _dir_with(g, p, {"num_hidden_layers": 10**6}), "num_hidden_layers=1000000"),
    "config-experts-2^31": (lambda g, p: _dir_with(g, p, {"architectures": ["MixtralForCausalLM"],
                                                          "model_type": "mixtral", "num_local_experts": 2**31}),
                            "num_local_experts=2147483648"),
    # Qwen2's window flags were spelled out as a list with one entry per layer before any tensor was seen
    "qwen2-window-over-2^31-layers": (lambda g, p: _dir_with(g, p, {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_hidden_layers": 2**31,
        "use_sliding_window": True, "max_window_layers": 0, "sliding_window": 64}), "num_hidden_layers=2147483648"),
    "gguf-block-count-2^31": (lambda g, p: _gguf_with_layers(g, p, 2**31), "block_count=2147483648"),
    "gguf-block-count-10^6": (lambda g, p: _gguf_with_layers(g, p, 10**6), "block_count=1000000"),
    "tokenizer-id-10^7": (lambda g, p: _dir_with(g, p, tokenizer=_token_at(10**7)), "vocab_size 272"),
}


@pytest.mark.parametrize("case", LIES)
def test_a_lying_size_is_refused_before_anything_is_sized_by_it(case, good, tmp_path, wait_bound):
    make, named = LIES[case]
    path = make(good, tmp_path)
    tracemalloc.start()
    try:
        with pytest.raises(MiniLLMError) as error:
            minillm.load(str(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(error.value)
    assert named in message and "\n" not in message, message
    assert peak < PEAK_BYTES, f"{peak / 2**20:.0f} MB traced while refusing: something was sized by the lie"


def test_a_tokenizer_whose_ids_skip_ten_million_is_refused_before_it_is_built(good, tmp_path, wait_bound):
    """Alone (no model's vocab_size to hold it to), the ids must still number the tokens present."""
    path = _dir_with(good, tmp_path, tokenizer=_token_at(10**7))
    tracemalloc.start()
    try:
        with pytest.raises(MiniLLMError, match="the token id 10000000 leaves"):
            load_tokenizer(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < PEAK_BYTES, f"{peak / 2**20:.0f} MB traced while refusing"
    assert load_tokenizer(_dir_with(good, tmp_path / "holes", tokenizer=_token_at(400))).vocab_size == 401  # a few holes load


@pytest.mark.parametrize("case", ["config-layers-2^31", "gguf-block-count-2^31"])
def test_the_cli_refuses_a_lying_layer_count_in_one_line(case, good, tmp_path):
    make, named = LIES[case]
    path = make(good, tmp_path)
    env = os.environ | {"MINILLM_THREADS": "1"}
    # timeout: a wait bound for the hang this was (the refusal itself takes the CLI's start-up time)
    result = subprocess.run([sys.executable, "-m", "minillm", "generate", "--model", str(path), "--max-tokens", "2",
                             "hello"], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("minillm: error: ") and named in lines[0], result.stderr
