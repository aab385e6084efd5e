"""Reading a checkpoint whatever its format: a weights folder in HF layout, or a .gguf file."""
from __future__ import annotations

from pathlib import Path

from minillm.checkpoints.gguf_quantized import load_gguf_for_cpu
from minillm.errors import MiniLLMError
from minillm.checkpoints.tokenizer_files import NoTokenizer, tokenizer_from_gguf, tokenizer_from_hf
from minillm.checkpoints.weights import load_hf_dir


def read_checkpoint(path: str | Path, gguf: str = "auto"):
    """(config, HF-named tensors, tokenizer or None) from a weights folder or a .gguf file.
    gguf: how a GGUF's quantized matrices load, "auto" | "kept" | "float" (gguf_quantized.load_gguf_for_cpu)."""
    path = Path(path)
    if path.suffix == ".gguf":
        config, tensors = load_gguf_for_cpu(path, how=gguf)
        tokenizer = _quietly(tokenizer_from_gguf, path)
    else:
        config, tensors = load_hf_dir(path, gguf=gguf)
        tokenizer = tokenizer_from_hf(path, config.vocab_size) if (path / "tokenizer.json").exists() else None
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:   # its ids would index past the embedding
        raise MiniLLMError(f"{path}: the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                           f"{config.vocab_size}: they do not belong together")
    return config, tensors, tokenizer


def _quietly(make, path):
    """A GGUF's tokenizer, or None when it holds none (the model still loads); a corrupt one is an error."""
    try:
        return make(path)
    except NoTokenizer:
        return None
