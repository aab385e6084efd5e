"""The engine's own Transformer with its arrays on the GPU: the path for every model without kernels.

    gpu = to_device(cpu_model, dtype="float16")    # a minillm.model.transformer.Transformer on CuPy arrays
    cache = gpu.new_cache(256)                     # made on the device (16-bit latents for MLA)
    logits = gpu.prefill(ids, cache)               # float32 numpy [vocab], copied back to the host

Nothing here re-describes the model: the copy's forward pass is model/transformer.py's, and every layer function
makes its masks, positions and buffers with `backend.array_module(x)`, so the same code runs on NumPy (how the CPU
tests run this very conversion) and on CuPy (every matmul a cuBLAS call). It runs what has no kernels (the table
in minillm/cuda/__init__.py). Matrices are held in 16 bits (fp8/NF4/MXFP4/int8/int4 widened at upload), gains in
fp32, the cache in `cache_dtype` (or an int8/fp8 kv_cache's codes and scales, computed on the device).
Activations and every matmul are fp32: `layers.linear` widens a 16-bit weight before its cuBLAS call, a write and
a read of 4 bytes per weight on top of the 2 stored: simple and exact, not the roofline. No CUDA graph: CuPy's
cuBLAS calls cannot be captured. MLA prefill expands every head's keys once for a chunk ("naive-prefill").
"""
from __future__ import annotations

from dataclasses import fields, replace

import numpy as np

from minillm.backend import array_module, to_dtype
from minillm.model.quant import QuantizedWeight
from minillm.model.transformer import LayerWeights, Transformer

DTYPES = ("float16", "bfloat16", "float32")    # float32: lesson 11 (the CPU's numbers on the GPU)
CACHE_DTYPES = ("float16", "float32")
NORMS = ("q_norm", "kv_norm")              # MLA's latent gains: fp32 on the device
STACKS = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}   # the fused names and their views


def _cupy():
    import cupy
    return cupy


def to_device(model: Transformer, dtype: str = "float16", xp=None, cache_dtype: str = "float16",
              mla_mode: str = "naive-prefill") -> Transformer:
    """A copy of `model` (a CPU Transformer) whose arrays live in `xp` (default CuPy): matrices in `dtype`,
    norm gains fp32, a tied LM head uploaded once. Its caches are made in `xp` too: `cache_dtype` for the float
    ones, an int8 or fp8 kv_cache as int8 / E4M3 codes with fp32 scales (kv_cache.py, quantized on the device)."""
    xp = xp if xp is not None else _cupy()
    if dtype not in DTYPES:
        raise ValueError(f"GPU weights are float16, bfloat16 or float32, not {dtype!r}")
    if cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"the device cache is float16 or float32, not {cache_dtype!r}")
    if model.flashnorm:
        raise ValueError("FlashNorm models are not supported by the GPU's Transformer path yet")
    if xp is not np:                   # checked before allocating: every matrix lands in 16 bits, even fp8/4-bit ones
        need = model.config.n_params * (4 if dtype == "float32" else 2)
        free = xp.cuda.Device().mem_info[0]
        if need > 0.9 * free:
            raise ValueError(f"the model needs about {need / 1e9:.1f} GB on the GPU in {dtype} (this path holds every "
                             f"matrix in 16 bits), and {free / 1e9:.1f} GB are free: use --device cpu")
    sent: dict[int, object] = {}

    def dev(a, narrow: bool = True):
        """One host array on the device (each host array sent once: views and ties stay shared). A quantized
        matrix (fp8, NF4, MXFP4, int8, int4) is widened to `dtype` here: no kernel computes in those formats
        yet, so the device holds the values they encode, in 16 bits (minillm info --device cuda says so)."""
        if a is None:
            return None
        if id(a) not in sent:
            host = a.dequantize() if isinstance(a, QuantizedWeight) else np.asarray(a)
            sent[id(a)] = xp.asarray(to_dtype(host, dtype if narrow else "float32"))
        return sent[id(a)]

    gpu = model.with_options(mla_mode=mla_mode) if model.config.attention == "mla" else model.with_options()
    gpu.embed, gpu.final_norm = dev(model.embed), dev(model.final_norm, narrow=False)
    gpu.lm_head = dev(model.lm_head)
    gpu.inv_freq = xp.asarray(model.inv_freq)
    for name in ("inv_freq_long", "inv_freq_local"):        # LongRoPE's long factors, Gemma 3's windowed layers
        if getattr(model, name, None) is not None:
            setattr(gpu, name, xp.asarray(getattr(model, name)))
    gpu.cache_dtype = {"float16": xp.float16, "float32": xp.float32}[cache_dtype]
    gpu.layers = [_device_layer(L, dev) for L in model.layers]
    gpu.dtype = dtype
    return gpu


def _device_layer(L: LayerWeights, dev) -> LayerWeights:
    """One layer on the device in the engine's own layout: q|k|v and gate|up stay single stacks, the
    separate names views of them (one matmul for q, k and v, as on the CPU)."""
    moved = {}
    for stack, parts in STACKS.items():
        if getattr(L, stack) is not None:
            whole = dev(getattr(L, stack))
            edges = np.cumsum([len(getattr(L, p)) for p in parts[:-1]]).tolist()
            moved |= {stack: whole} | dict(zip(parts, array_module(whole).split(whole, edges)))   # row views
    if L.moe is not None:                                         # router, experts and biases: each moved once
        expert = lambda e: None if e is None else replace(e, w_gate=dev(e.w_gate), w_up=dev(e.w_up),
                                                         w_down=dev(e.w_down), biases=None if e.biases is None
                                                         else tuple(dev(b, narrow=False) for b in e.biases))
        moe = L.moe
        moved["moe"] = replace(moe, router=dev(moe.router, narrow=False), experts=[expert(e) for e in moe.experts],
                               bias=dev(moe.bias, narrow=False), shared=expert(moe.shared),
                               router_bias=dev(moe.router_bias, narrow=False))
    for f in fields(L):
        value = getattr(L, f.name)
        if f.name in moved or value is None:
            continue
        if f.name == "bias":                                      # additive biases, [out] each: fp32
            moved["bias"] = {k: dev(b, narrow=False) for k, b in value.items()}
        elif f.name == "mla":
            moved["mla"] = replace(value, **{g.name: dev(getattr(value, g.name), g.name not in NORMS)
                                             for g in fields(value)})
        else:                                                     # matrices narrow; gains and sinks ([n]) fp32
            moved[f.name] = dev(value, isinstance(value, QuantizedWeight) or np.ndim(value) == 2)
    return replace(L, **moved)


def weight_bytes(model: Transformer) -> int:
    """Bytes of the matrices a decode step reads, as stored (norm gains left out)."""
    return sum(a.nbytes for a in model.weights_read_per_token() if a.ndim == 2)
