"""The laboratory of the GPU path, kept apart from the engine (llm.c's dev/ style): every earlier kernel version
and every experiment that lost, with the measuring code.

`lab.py` is the one entry point for version ladders (lessons, minillm.course, the modules here): `LabSettings`
(the shipped KernelSettings plus the lab's choices), `LabKernels` (the shipped launchers plus gemv v1-v3, the
quantized GEMV v1, v3 on tensor cores and v4 streamed by the TMA) and `LabTransformer` (the earlier decode steps,
prefill widening one GEMM ahead: `widen_ahead.py`). Their kernels are in `kernels/` (shipped as package data;
they include the shipped headers of the top-level kernels/). What each measured: lessons/BENCHMARKS_HISTORY.md.

One module per kernel family, each with its NumPy references, its checks (random inputs, NaN-poisoned
outputs, (error, tolerance) back) and its sweep, runnable alone: `python -m minillm.cuda.dev.gemv`
(gemv.cu, gemv_quant.cu), `.attention` (decode/prefill attention, the KV append), `.elementwise`
(rmsnorm, rope, swiglu, embed), `.paged_attention` (the batching engine's kernels), `prefill_mma.py` (a NumPy
lane-by-lane model of prefill_attention_mma.cu, to check its fragment layouts on the CPU),
`.flashnorm` (the deferred norm: two streams, fused). They time with production's timer and bandwidth probe
(minillm/cuda/timing.py) and report as the selfcheck does; `model.py` runs production's model checks (GPU vs
CPU, minillm/cuda/selfcheck.py) on the lab's decode steps too; `qbench.py` times a 7B-shaped model's quantized
GEMVs, `sweep.py` holds what the same-run decode sweeps share; `qmma.py` (the quantized GEMV on tensor
cores), `qtma.py` (the GEMVs with their weights streamed into shared memory by the TMA) and `qfloor.py` (the
quantized GEMV with its staging or its arithmetic taken out: where its time goes) measure kernel versions;
`chain.py` measures the decode step as a chain (what each kind of kernel adds inside it), `widen.py` prefill's
int8/int4 widening one GEMM ahead, `ab.py` one setting against the defaults, `pdl.py` programmatic dependent
launch on and off; `selfcheck.py` runs the kernel families' checks and the lab's model checks, then
production's timing (minillm.cuda.selfcheck; the full tables: `minillm bench --device cuda`, tools/gpu_bench.py); `verify.sh` is the whole GPU verification as one command for the GPU machine, and
`ab_commit.sh` this checkout against an earlier one (logits bit for bit, decode and TTFT in alternating rounds,
bench serve). Nothing in the engine, the CLI's tools or the production measures imports this package (an
import-linter contract in setup.cfg holds it).
"""
