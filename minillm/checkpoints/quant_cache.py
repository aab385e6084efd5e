"""Quantizing a checkpoint once: `load(..., quant=...)` keeps the quantized copy beside the weights and
reuses it while the source is unchanged.

int4's calibration and grid search took 80 s for a 1.2B model here at every load (about 8 minutes for a
7B: lessons/BENCHMARKS.md, "Quantizing once"). The result is what `minillm convert --quant` writes, so it
is written once, to `<weights>/.quantized/<method>[-g<group>]/` (`<file>.quantized/...` beside a .gguf),
with the source's fingerprint (each weight file's name, size and modification time, and the quantizer's
settings); a later load whose fingerprint matches memory-maps it instead (a second or less).
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from minillm.checkpoints.quantize import quantize_checkpoint
from minillm.checkpoints.weights import GGUF_WEIGHTS, SAFETENSORS_INDEX, load_hf_dir, save_hf_dir
from minillm.model.config import ModelConfig
from minillm.model.quant import CALIBRATION_TOKENS, CALIBRATION_WINDOW, LLOYD_ROUNDS, SEARCH_SHIFTS

CACHE_DIR = ".quantized"
FINGERPRINT = "source.json"       # written last: its presence means the copy is complete


def cache_folder(source: Path, method: str, group_size: int) -> Path:
    root = source / CACHE_DIR if source.is_dir() else source.with_name(source.name + CACHE_DIR)
    return root / (f"{method}-g{group_size}" if method == "int4" else method)


def fingerprint(source: Path, method: str, group_size: int) -> dict:
    """What the quantized copy was made from: the files holding the weights and config, and how."""
    if source.is_dir():
        files = [p for p in sorted(source.iterdir()) if p.is_file() and (
            p.suffix == ".safetensors" or p.name in ("config.json", SAFETENSORS_INDEX, GGUF_WEIGHTS))]
    else:
        files = [source]
    quantizer = [CALIBRATION_TOKENS, CALIBRATION_WINDOW, LLOYD_ROUNDS, [float(t) for t in SEARCH_SHIFTS]]
    return {"method": method, "group_size": group_size, "quantizer": quantizer,
            "files": {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in files}}


def quantize_cached(source: str | Path, config: ModelConfig, tensors: dict, method: str,
                    group_size: int) -> tuple[ModelConfig, dict]:
    """quantize_checkpoint of the checkpoint loaded from `source`, or the copy kept from an earlier load."""
    source = Path(source)
    folder = cache_folder(source, method, group_size)
    wanted = fingerprint(source, method, group_size)
    try:
        if json.loads((folder / FINGERPRINT).read_text()) == wanted:
            kept, tensors = load_hf_dir(folder)        # the stop ids are the source's generation_config.json's
            return replace(kept, generation_eos_token_ids=config.generation_eos_token_ids), tensors
    except (OSError, ValueError):
        pass                                           # none yet, or an older one: quantize again
    config, tensors = quantize_checkpoint(config, tensors, method, group_size)
    staging = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
        save_hf_dir(staging, config, tensors)
        (staging / FINGERPRINT).write_text(json.dumps(wanted, indent=1) + "\n")
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)
        print(f"minillm: note: kept the {method} weights in {folder} for the next load "
              f"({sum(p.stat().st_size for p in folder.iterdir()) / 1e9:.2f} GB)", file=sys.stderr)
    except OSError as e:                               # a read-only weights folder: quantize at every load
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        print(f"minillm: note: could not keep the {method} weights beside {source} ({e.strerror or e})",
              file=sys.stderr)
    return config, tensors
