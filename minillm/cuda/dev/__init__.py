"""Measuring code for the GPU path, kept apart from the engine (llm.c's dev/ style).

One module per kernel family, each with its NumPy references, its checks (random inputs, NaN-poisoned
outputs, (error, tolerance) back) and its sweep, runnable alone: `python -m minillm.cuda.dev.gemv`
(gemv.cu, gemv_quant.cu), `.attention` (decode/prefill attention, the KV append), `.elementwise`
(rmsnorm, rope, swiglu, embed), `.paged_attention` (the batching engine's kernels), `prefill_mma.py` (a NumPy
lane-by-lane model of prefill_attention_mma.cu, to check its fragment layouts on the CPU),
`.flashnorm` (the deferred norm: two streams, fused). `timing.py` is the one GPU timer and the one
bandwidth probe they all use; `model.py` checks whole small models GPU vs CPU; `bench.py` and
`qbench.py` time a 7B-shaped model (`minillm bench --device cuda`); `qmma.py` (the quantized GEMV on tensor
cores), `qtma.py` (the GEMVs with their weights streamed into shared memory by the TMA) and `qfloor.py` (the
quantized GEMV with its staging or its arithmetic taken out: where its time goes) measure kernel versions;
`chain.py` measures the decode step as a chain (what each kind of kernel adds inside it, prefetches across
its links), `layer.py` a layer's GEMVs as one kernel behind grid barriers, `widen.py` prefill's int8/int4
widening one GEMM ahead; `selfcheck.py` drives the kernel families' checks, the model checks and the bench;
`verify.sh` is the whole GPU verification as one command for the GPU machine. Nothing in the engine
imports this package.
"""
