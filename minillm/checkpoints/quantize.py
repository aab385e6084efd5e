"""Quantizing a checkpoint: every layer matrix of an HF-named tensor dict to int8 or int4 (with
int4's calibration run through the model), quantized conversions, and random checkpoints of any
shape. The formats and their matmuls are the model's (minillm.model.quant); this is the file side.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from minillm.backend import STORAGE_DTYPES, as_f32, to_dtype
from minillm.checkpoints.gguf_import import expected_shapes
from minillm.checkpoints.weights import SAFETENSORS, write_safetensors_stream
from minillm.errors import MiniLLMError
from minillm.model.config import ModelConfig
from minillm.model.quant import (CALIBRATION_TOKENS, CALIBRATION_WINDOW, LAYER_MATRICES, QuantizedWeight, check_method,
                                 is_layer_matrix, quantization_entry)
from minillm.model.quantized import quantize
from minillm.model.transformer import Transformer


def quantize_checkpoint(config: ModelConfig, tensors: dict[str, np.ndarray], method: str,
                        group_size: int = 128, progress: bool = False,
                        calibration_tokens: int = CALIBRATION_TOKENS) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Quantize every layer matrix of an HF-named checkpoint, one tensor at a time.

    The other tensors (norms, embedding, LM head) pass through untouched. Only one matrix is ever
    widened to fp32 at once, so memory holds the (memory-mapped) source plus the quantized result.
    int4 first runs `calibration_tokens` random tokens through the model to weight each matrix's
    grid search by its input columns' mean square (`input_importance`; 0: uniform weights).
    """
    check_method(config, method, group_size)
    if config.quantization:
        raise MiniLLMError(f"this checkpoint is already quantized ({config.quantization}); "
                           f"quantize the original weights instead")
    importance = {}
    if method == "int4" and calibration_tokens > 0:
        importance = input_importance(config, tensors, calibration_tokens, progress=progress)
    out: dict[str, np.ndarray] = {}
    for name, a in tqdm(tensors.items(), desc=f"quantizing to {method}", unit="tensor", disable=not progress):
        prefix = name.removesuffix(".weight")
        if is_layer_matrix(name):
            out.update(quantize(a, method, group_size, importance.get(name)).tensors(prefix))
        else:
            out[name] = a
    return config.replace(quantization=quantization_entry(method, group_size)), out


# ---- which input columns matter: activation statistics ----------------------------------------------
def input_importance(config: ModelConfig, tensors: dict[str, np.ndarray], n_tokens: int = CALIBRATION_TOKENS,
                     seed: int = 0, progress: bool = False) -> dict[str, np.ndarray]:
    """Mean square of every input column of every layer matrix, over `n_tokens` random token ids
    run through the model in windows of CALIBRATION_WINDOW.   -> {"model.layers.i.<part>.weight": [in]}

    Random ids, not text: what is measured (which channels carry large activations) is a property
    of the model, and no text that a perplexity test might use ever reaches the quantizer.

    The sums carry BLAS's rounding, which depends on its thread count: SmolLM2 calibrated on 1 vs 2
    threads gives another int4 grid in 0.14% of groups (measured). One machine and thread count
    reproduce the same checkpoint; to share one exactly, convert once and share the file."""
    recorders = {name: _InputRecorder(a) for name, a in tensors.items() if is_layer_matrix(name)}
    model = Transformer(config, {**tensors, **recorders})
    ids = np.random.default_rng(seed).integers(0, config.vocab_size, n_tokens)
    for start in tqdm(range(0, n_tokens, CALIBRATION_WINDOW), desc="calibrating", unit="window", disable=not progress):
        window = ids[start:start + CALIBRATION_WINDOW]
        # every row through every layer (prefill would run the last layer's MLP for its last row only)
        model.forward(window, model.new_cache(len(window)), skip_head=True)
    return {name: r.mean_square() for name, r in recorders.items()}


class _InputRecorder(QuantizedWeight):
    """Stands in for a layer matrix during calibration: multiplies like it (layers.linear calls
    `matmul`) and keeps the sum of squares of each input column."""

    def __init__(self, weight: np.ndarray):
        self.weight, self.sum_sq, self.rows = weight, np.zeros(weight.shape[1]), 0

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape

    def matmul(self, x: np.ndarray) -> np.ndarray:
        self.sum_sq += np.square(x).sum(axis=0, dtype=np.float64)          # [in]
        self.rows += x.shape[0]
        return x @ as_f32(self.weight).T

    def mean_square(self) -> np.ndarray:
        return (self.sum_sq / max(self.rows, 1)).astype(np.float32)


# ---- a random checkpoint of any shape, written one tensor at a time --------------------------------
def write_random_checkpoint(config: ModelConfig, dst: str | Path, quant: str | None = None,
                            group_size: int = 128, seed: int = 0, dtype: str = "bfloat16",
                            progress: bool = False) -> Path:
    """Write a random-weight checkpoint of `config`'s shape into `dst`, quantized or in `dtype`.

    Proves that a model of a real size loads and runs in a given RAM without its weights: at most
    one tensor is in memory while writing. Quantized matrices get random codes and plausible scales
    (speed and memory do not depend on the values); norms are ones, other weights N(0, 0.02²).
    """
    if quant:
        check_method(config, quant, group_size)
    if quant not in (None, "int8", "int4"):
        raise MiniLLMError(f"random {quant} checkpoints are not written (int8/int4 only): quantize random float "
                           f"weights at load instead (load(..., quant={quant!r}))")
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    float_dtype = np.dtype(STORAGE_DTYPES[dtype])
    specs: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}
    for name, shape in expected_shapes(config).items():
        prefix = name.removesuffix(".weight")
        if quant and name.startswith("model.layers.") and prefix.split(".", 3)[3] in LAYER_MATRICES:
            out_dim, in_dim = shape
            if quant == "int8":
                specs |= {prefix + ".qweight": (np.dtype(np.int8), shape),
                          prefix + ".scales": (np.dtype(np.float32), (out_dim,))}
            else:
                n_groups = -(-in_dim // group_size)
                specs |= {prefix + ".qweight": (np.dtype(np.uint8), (out_dim, n_groups * group_size // 2)),
                          prefix + ".scales": (np.dtype(np.float16), (out_dim, n_groups)),
                          prefix + ".mins": (np.dtype(np.float16), (out_dim, n_groups))}
        else:
            specs[name] = (float_dtype, shape)

    def produce(name: str) -> np.ndarray:
        d, shape = specs[name]
        if name.endswith(".qweight"):
            return rng.integers(-127 if d == np.int8 else 0, 128 if d == np.int8 else 256, shape, dtype=d)
        if name.endswith(".scales"):     # int8 codes ±127 -> ±0.06; int4 codes 0..15 -> [-0.06, 0.06]
            return np.full(shape, 0.06 / (127 if quant == "int8" else 7.5), dtype=d)
        if name.endswith(".mins"):
            return np.full(shape, -0.06, dtype=d)
        if len(shape) == 1:
            return to_dtype(np.ones(shape, np.float32), dtype)
        return to_dtype(rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02), dtype)

    write_safetensors_stream(dst / SAFETENSORS, specs, produce, progress=progress)
    config = config.replace(torch_dtype=dtype, quantization=quantization_entry(quant, group_size) if quant else None)
    (dst / "config.json").write_text(json.dumps(config.to_hf(), indent=2) + "\n")
    return dst
