"""The model: one Llama-family forward pass, written once over NumPy or CuPy arrays.

`config` (ModelConfig and the presets), `layers` (RMSNorm, RoPE, SwiGLU, linear), `attention`
(MHA/GQA/MQA, sliding window), `mla` (DeepSeek's latent attention), `kv_cache` (the caches a single
sequence decodes against), `quant` and `flashnorm` (the math of quantized and deferred-norm matmuls),
and `transformer` (the `Transformer` itself, prefill and decode). Nothing here reads or writes files:
this package may import numpy, `minillm.backend` and `minillm.errors`, never a higher layer.
"""
