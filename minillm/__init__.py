"""minillm: a small, readable LLM inference engine on NumPy, with a course of lessons."""
from minillm.model.config import PRESETS, ModelConfig
from minillm.engine.engine import Engine
from minillm.engine.generate import Generation
from minillm.llm import LLM, load

__version__ = "0.1.0"


def load_tokenizer(path):
    """A tokenizer on its own, from a .gguf (vocabulary-only files too) or a tokenizer.json folder/file."""
    from minillm.checkpoints.tokenizer_files import load_tokenizer as _load
    return _load(path)


__all__ = ["load", "load_tokenizer", "LLM", "ModelConfig", "Generation", "PRESETS", "Engine"]
