"""llama.cpp's own GGUF converter for tests: convert_hf_to_gguf.py and the gguf-py it was written for, taken
from the llama-cpp-python sdist on PyPI (pinned), fetched once into a cache folder and reused by every session.

GGUF tests read files this converter wrote (not files written by minillm's reader's inverse). The
`llama_cpp_convert` fixture (conftest.py) gives `convert(hf_dir, outfile, outtype)`; it skips only where
the package index cannot be reached.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

VERSION = "0.3.36"                     # llama-cpp-python; its vendor/llama.cpp holds the converter
PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")     # what the converter needs of llama.cpp


def cache_root() -> Path:
    """~/.cache/minillm-test (or $XDG_CACHE_HOME/minillm-test): shared by every session and checkout."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "minillm-test"


def index_reachable(timeout: float = 15.0) -> bool:
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple/").rstrip("/")
    try:
        urllib.request.urlopen(f"{index}/llama-cpp-python/", timeout=timeout).close()
        return True
    except OSError:
        return False


def converter_dir() -> Path | None:
    """The folder holding convert_hf_to_gguf.py (fetched the first time); None if the index is unreachable."""
    root = cache_root() / f"llama-cpp-python-{VERSION}"
    if (root / "convert_hf_to_gguf.py").is_file():
        return root
    if not index_reachable():
        return None
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={VERSION}", "--no-deps",
                        "--no-binary", ":all:", "-d", tmp, "-q"], check=True)
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
        staged = Path(tmp) / "converter"
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                inner = member.name.removeprefix(prefix)
                if member.name.startswith(prefix) and member.isfile() and inner.startswith(PARTS):
                    member.name = inner
                    tar.extract(member, staged, filter="data")
        try:
            staged.rename(root)                        # atomic: a concurrent session may have won the race
        except OSError:
            if not (root / "convert_hf_to_gguf.py").is_file():
                raise
    return root


def run_converter(root: Path, hf_dir: Path, outfile: Path, outtype: str) -> Path:
    """llama.cpp's convert_hf_to_gguf.py on an HF folder (outtype: f32, f16, bf16, q8_0). It puts its own
    gguf-py first on sys.path, so it runs with the gguf it was written for, whatever is installed."""
    result = subprocess.run([sys.executable, str(root / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile",
                             str(outfile), "--outtype", outtype], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{result.stderr[-3000:]}")
    return outfile


# ---- a tiny Llama the converter accepts -------------------------------------------------------------
def save_tiny_llama(path: Path, hidden: int = 256, ffn: int = 512, layers: int = 2, seed: int = 0):
    """A random HF Llama (every input width a multiple of 256: the K-quants' block) with a 289-token
    Llama-style BPE tokenizer (byte fallback: the converter reads it as llama.cpp's "llama" vocab)."""
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    from hf_models import llama_config, save_random_model
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in [*"▁abcdefghijklmnopqrstuvwxyz", "▁t", "th", "▁th"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "t"), ("t", "h"), ("▁t", "h")], unk_token="<unk>",
                               byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    config = llama_config(n_heads=4, n_kv_heads=2, hidden_size=hidden, intermediate_size=ffn,
                          num_hidden_layers=layers, vocab_size=len(vocab), bos_token_id=1, eos_token_id=2)
    return save_random_model(config, path, seed=seed)


def alone(gguf: Path, folder: Path) -> Path:
    """The GGUF linked into a folder of its own, for HF's from_pretrained(folder, gguf_file=name)."""
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / gguf.name
    if not link.exists():
        shutil.copyfile(gguf, link)
    return folder
