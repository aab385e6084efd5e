"""Converting checkpoints: a .gguf or an HF-layout folder into a minillm weights folder (`convert`),
quantized on the way if asked, or with FlashNorm's gains folded (`convert_flashnorm`). Fewer KV heads
is `kv_heads.convert_kv_heads_dir`; `minillm convert` chains them (tools/convert.py).
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from minillm.checkpoints.gguf_import import config_from_gguf, default_dtype, load_gguf, open_gguf
from minillm.checkpoints.quantize import quantize_checkpoint
from minillm.checkpoints.tokenizer_files import save_hf, tokenizer_from_gguf
from minillm.checkpoints.weights import GGUF_WEIGHTS, SAFETENSORS, SAFETENSORS_INDEX, copy_tokenizer_files, load_hf_dir, save_hf_dir
from minillm.errors import MiniLLMError
from minillm.model.flashnorm import FoldReport, fold_checkpoint


def convert(src: str | Path, dst: str | Path, progress: bool = True, dtype: str | None = None,
            quant: str | None = None, group_size: int = 128) -> Path:
    """A .gguf file or an HF dir -> a minillm weights dir at `dst` (config.json, model.safetensors,
    tokenizer files). dtype as in `load_gguf`; for an HF dir None keeps the stored dtype.
    quant: "int8" | "int4" stores the layer matrices quantized (quant.py; groups of `group_size`)."""
    src, dst = Path(src), Path(dst)
    if src.is_file():
        reader = open_gguf(src)
        config, tensors = load_gguf(src, dtype=dtype, progress=progress, reader=reader)
        if quant:
            config, tensors = quantize_checkpoint(config, tensors, quant, group_size, progress)
        try:
            tokenizer = tokenizer_from_gguf(reader)
        except (KeyError, ValueError) as e:
            raise MiniLLMError(f"{src}: cannot read its tokenizer ({type(e).__name__}: {e})") from None
        return save_hf_dir(dst, config, tensors, tokenizer=tokenizer, progress=progress)
    if src.is_dir():
        if dst.exists() and dst.resolve() == src.resolve():
            raise MiniLLMError(f"{dst}: convert cannot write into its own source dir")
        config, tensors = load_hf_dir(src)
        if quant:
            config, tensors = quantize_checkpoint(config, tensors, quant, group_size, progress)
        copy_tokenizer_files(src, dst)
        return save_hf_dir(dst, config, tensors, dtype=dtype, progress=progress)
    raise MiniLLMError(f"{src}: no such file or directory")


def keep_gguf(dst: str | Path) -> Path:
    """Make the folder `dst`, holding a GGUF as GGUF_WEIGHTS, a weights folder without converting the
    weights: config.json and the tokenizer files come from the GGUF's metadata, and load_hf_dir
    dequantizes the GGUF itself at load (exact values; 98 MB instead of 538 MB for SmolLM2).
    config.json is written last: its presence means the folder is complete."""
    dst = Path(dst)
    gguf = dst / GGUF_WEIGHTS
    reader = open_gguf(gguf)
    config = config_from_gguf(reader, gguf)
    try:
        tokenizer = tokenizer_from_gguf(reader)
    except (KeyError, ValueError) as e:
        raise MiniLLMError(f"{gguf}: cannot read its tokenizer ({type(e).__name__}: {e})") from None
    for stale in (SAFETENSORS, SAFETENSORS_INDEX, "config.json"):   # an older pull's fp32 copy would win at load
        (dst / stale).unlink(missing_ok=True)
    save_hf(tokenizer, dst)
    config = config.replace(torch_dtype=default_dtype(config))       # what the GGUF dequantizes to at load
    (dst / "config.json").write_text(json.dumps(config.to_hf(), indent=2) + "\n")
    return dst


def convert_flashnorm(src: str | Path, dst: str | Path, untie: bool = False, dtype: str | None = None,
                      quant: str | None = None, group_size: int = 128, progress: bool = False) -> FoldReport:
    """Write the checkpoint at `src` (HF folder or .gguf) to `dst` with its norm gains folded (all-ones
    norms: HF transformers loads it as an ordinary Llama), quantized afterwards if asked."""
    src, dst = Path(src), Path(dst)
    if not src.exists():
        raise MiniLLMError(f"{src}: no such file or directory")
    if src.is_file():                       # a .gguf: to an HF folder first, then fold that
        with tempfile.TemporaryDirectory() as tmp:
            convert(src, tmp, progress=progress, dtype=dtype)
            return convert_flashnorm(tmp, dst, untie, None, quant, group_size, progress)
    if dst.exists() and dst.resolve() == src.resolve():
        raise MiniLLMError(f"{dst}: the destination must differ from the source (its weights are being read)")
    config, tensors = load_hf_dir(src)
    config, tensors, report = fold_checkpoint(config, tensors, untie)
    if quant:
        config, tensors = quantize_checkpoint(config, tensors, quant, group_size, progress)
    copy_tokenizer_files(src, dst)
    save_hf_dir(dst, config, tensors, dtype=dtype, progress=progress)
    return report
