"""Reading a checkpoint whatever its format: a weights folder in HF layout, or a .gguf file."""
from __future__ import annotations

from pathlib import Path

from minillm.checkpoints.gguf_import import load_gguf
from minillm.checkpoints.tokenizer_files import NoTokenizer, tokenizer_from_gguf, tokenizer_from_hf
from minillm.checkpoints.weights import load_hf_dir


def read_checkpoint(path: str | Path):
    """(config, HF-named tensors, tokenizer or None) from a weights folder or a .gguf file."""
    path = Path(path)
    if path.suffix == ".gguf":
        config, tensors = load_gguf(path)
        return config, tensors, _quietly(tokenizer_from_gguf, path)
    config, tensors = load_hf_dir(path)
    has_tokenizer = (path / "tokenizer.json").exists()
    return config, tensors, tokenizer_from_hf(path) if has_tokenizer else None


def _quietly(make, path):
    """A GGUF's tokenizer, or None when it holds none (the model still loads); a corrupt one is an error."""
    try:
        return make(path)
    except NoTokenizer:
        return None
