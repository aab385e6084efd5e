"""The GPU backend: what is GPU-specific and nothing else.

What runs a checkpoint on the GPU (`minillm.load(..., device="cuda")`): `llm.gpu_path` picks the model,
`llm.batching_for` the runner that serves many requests at once (the Engine); tests/test_gpu_dispatch.py holds
this table against both.

    checkpoint                                  | model (one request)            | many at once (Engine)
    dense attention (MHA/GQA/MQA), fp16 or bf16 | GPUTransformer (gpu_model.py)  | GPUBatching (gpu_batched.py)
    dense, int8/int4 weights or int8 KV cache   | GPUTransformer (gpu_model.py)  | GPUBatching (gpu_batched.py)
    MLA of a shape mla_decode.cu takes          | GPUMLATransformer (gpu_mla.py) | CPUBatching (its prefill model)
    MLA of another shape (widths % 8 != 0)      | device_model (device_model.py) | CPUBatching (the same model)
    a piece the kernels lack (gpu_model.py)     | device_model (device_model.py) | CPUBatching (the same model)
    a tensor-parallel shard (--tp N)            | device_model (device_model.py) | TPBatching (engine/parallel)

The pieces the kernels lack (gpu_model.unsupported says which): mixture-of-experts layers (Mixtral, Qwen3-MoE,
GPT-OSS), biases (Qwen2, GPT-OSS), QK-norm (Qwen3, Gemma 3), Gemma's norms, GeGLU, per-layer windows and
softcapping, partial RoPE and LongRoPE/YaRN (Phi, GPT-OSS), attention sinks, fp8/NF4/MXFP4 weights (widened to
16 bits there), an fp8 KV cache; `minillm info --device cuda` prints the reason. device_model keeps an int8 or
fp8 KV cache on the device, quantized there to the CPU's codes and scales (model/kv_cache.py). Refused in one
line at load: device_model with FlashNorm, and a model whose 16-bit matrices would not fit in the GPU's free memory.

`kernels.py` compiles kernels/*.cu (NVRTC, through CuPy's RawModule) and wraps each launch; `forward.py` is the
one layer loop over packed rows, run by a prompt chunk and a batching step alike (cuBLAS GEMMs; attention through
an ops object: the paged pool's, or gpu_model.ContiguousOps for one sequence's cache); `gpu_model.py` is the fast
path for Llama-family models: that loop for prefill, and a decode step of our kernels only, captured once as a
CUDA graph and replayed per token (`graph.py`), its caches in `gpu_kv_cache.py`, its int8/int4 matrices in
`qweights.py`; `gpu_mla.py` is the same for MLA decode; `device_model.py` runs the engine's own Transformer on
CuPy arrays. Each operation ships one kernel, the fastest measured, and a named fallback only for the shapes it
cannot take (kernels.py says which). `timing.py` (the timer, bandwidth probe and decode/TTFT timers) and
`selfcheck.py` (`python -m minillm.cuda.selfcheck`: the shipped path against the CPU model, then timed) measure
what ships; `minillm bench --device cuda` prints the full tables (minillm/tools/gpu_bench.py). Earlier versions
and losing experiments live in the laboratory `dev/` (entry point `dev/lab.py`; nothing here imports it). No
environment variable is read here: choices are constructor arguments.

Importing this package does not import CuPy; `available()` says whether a GPU can be used.
"""
from __future__ import annotations


def available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False
