#!/usr/bin/env bash
# The whole GPU verification of a checkout in one command, for one call on the GPU machine (10 minutes):
#   the GPU test suite (+ the real SmolLM2 cut when .smollm2/pieces.npz came along), the selfcheck driver,
#   lessons 06, 10-15, 17, 24 (quick), `minillm bench --device cuda` for fp16/int8/int4 and `minillm bench serve`.
# Each step has its own time limit and log in $OUT; the last lines of each are printed.
#   here:   (cd tests && python -c "from pathlib import Path; import smollm2_pieces as s;
#            s.pack(Path('<smollm2 dir>'), Path('../.smollm2/pieces.npz'), 8, tokenizer=True)")
#   there:  bash minillm/cuda/dev/verify.sh [steps...]     (steps: suite selfcheck lessons bench serve; also
#           smollm2: the suite's SmolLM2 tests alone;
#           dev: each dev module's checks and sweep; full: the selfcheck without --quick;
#           spec: speculative decoding's GPU tests and step costs; specbench: bench --speculative on SmolLM2;
#           prefill: prefill attention v2's GPU tests, checks, v1 vs v2 µs a layer and TTFT;
#           flashnorm: FlashNorm at every norm site of the decode step, --e2e table, its tests and lesson 15;
#           pdl: programmatic dependent launch, its tests and tok/s on and off;
#           qmma: the quantized GEMV v3 (tensor cores): its checks, v2 vs v3 per matrix and in decode, its tests;
#           qtma: the quantized GEMV v4 (weights streamed into shared memory by the TMA): checks, per matrix, decode;
#           qfloor: where the quantized GEMV's time goes (dev/qfloor.py: staging or arithmetic taken out) and
#           the variants that keep v2's results (staging, prefetch, warps an SM, steps): their checks, per matrix
#           and in decode (QFLOOR_VARIANTS="a,b": only those);
#           chain: the decode step as a chain (dev/chain.py): each kind of kernel left out, the prefetches across
#           kernels (CHAIN_ARGS: its options), and their tests;
#           widen: prefill's int8/int4 widening one GEMM ahead (dev/widen.py), its tests and TTFT both ways;
#           ab: one KernelSettings change against the defaults (dev/ab.py; AB_SET="name=value", AB_FORMATS);
#           bprefill: the batching engine's prefill attention on the tensor cores (its default): its
#           GPU tests, paged vs mma µs a layer, then bench serve with it;
#           commit: this checkout against the one at .base (ab_commit.sh: logits bit for bit, decode tok/s and
#           TTFT in alternating rounds, bench serve; a step of its own: it needs most of a call))
set -u
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/verify}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2
STEPS=${*:-suite selfcheck lessons bench serve}

step() {   # step NAME SECONDS COMMAND...: run it under a limit, log to $OUT/NAME.log, show its end
    local name=$1 limit=$2; shift 2
    echo "=== $name  $(date -u +%H:%M:%S)  $*"
    timeout "$limit" "$@" >>"$OUT/$name.log" 2>&1
    echo "--- rc=$?"
    tail -n "${TAIL:-12}" "$OUT/$name.log"
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv,noheader
python3 -c "import cupy, numpy, torch; print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'torch', torch.__version__)"
if [ -f .smollm2/a.npz ] && [ -f .smollm2/b.npz ]; then     # the whole model, uploaded by two calls in a row
    python3 tests/smollm2_pieces.py unpack .smollm2/a.npz,.smollm2/b.npz /tmp/smollm2 >/dev/null && export MINILLM_TEST_SMOLLM2=/tmp/smollm2
elif [ -f .smollm2/pieces.npz ]; then                        # the first layers, one upload
    python3 tests/smollm2_pieces.py unpack .smollm2/pieces.npz /tmp/smollm2 >/dev/null && export MINILLM_TEST_SMOLLM2=/tmp/smollm2
fi
echo "SmolLM2: ${MINILLM_TEST_SMOLLM2:-none (its tests are deselected: no network to pull it there)}"
SELECT=(); [ -z "${MINILLM_TEST_SMOLLM2:-}" ] && SELECT=(-k "not smollm2")
SUITE="tests/test_cuda.py tests/test_cuda_kv_int8.py tests/test_cuda_quant.py tests/test_cuda_load.py
    tests/test_flashnorm_gpu.py tests/test_gpu_engine.py tests/test_cuda_mla.py tests/test_decode_launches.py
    tests/test_kernels_compile.py tests/test_gpu_imports.py tests/test_speculative_gpu.py tests/test_cuda_small_m.py
    tests/test_cuda_pdl.py tests/test_pdl.py tests/test_gpu_mla.py tests/test_qtma_plan.py tests/test_qfloor.py
    tests/test_chain.py tests/test_cuda_widen_ahead.py tests/test_widen_ahead.py
    tests/test_dev_ab.py"
for s in $STEPS; do case $s in
suite)
    step suite 330 python3 -m pytest -q -n 8 -p no:cacheprovider -o addopts="" "${SELECT[@]}" $SUITE ;;
smollm2)   # only the suite's real-SmolLM2 tests (after a suite run without them)
    step smollm2 240 python3 -m pytest -q -n 8 -p no:cacheprovider -o addopts="" -rP -k smollm2 $SUITE ;;
spec)      # speculative decoding: the GPU tests (-rP: SmolLM2's tables), step costs at Mistral-7B's shape, bench
    TAIL=40 step spec 200 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rP "${SELECT[@]}" \
        tests/test_speculative_gpu.py
    TAIL=30 step spec 150 python3 -m minillm.cuda.dev.speculative ;;
specbench) # minillm bench --speculative on the real SmolLM2 (needs it): each drafter vs plain decoding
    for s in ngram int4 layers:20; do
        TAIL=10 step specbench 120 python3 -m minillm bench --speculative $s --device cuda \
            -m "${MINILLM_TEST_SMOLLM2:?specbench needs the SmolLM2 pieces}" --new-tokens 64
    done ;;
selfcheck)
    step selfcheck 150 python3 -m minillm.cuda.selfcheck --quick ;;
lessons)
    for n in 06 10 11 12 13 14 15 17 24; do
        MINILLM_LESSON_QUICK=1 MINILLM_LESSON_MODEL=${MINILLM_TEST_SMOLLM2:-random:smollm2-135m} \
            TAIL=4 step lessons 120 python3 lessons/${n}_*.py
    done ;;
dev)
    for m in elementwise gemv attention paged_attention "flashnorm --quick" qbench "small_m --quick"; do
        TAIL=6 step dev 150 python3 -m minillm.cuda.dev.$m
    done ;;
prefill)   # prefill attention v2 (tensor cores): its GPU tests, then checks + v1/v2 µs a layer + TTFT
    step prefill 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" -k prefill_attention tests/test_cuda.py
    TAIL=40 step prefill 150 python3 -m minillm.cuda.dev.attention --prefill ;;
full)
    TAIL=20 step full 240 python3 -m minillm.cuda.selfcheck ;;
flashnorm)
    TAIL=30 step flashnorm 240 python3 -m minillm.cuda.dev.flashnorm --e2e
    step flashnorm 200 python3 -m pytest -q -n 4 -p no:cacheprovider -o addopts="" tests/test_flashnorm_gpu.py \
        tests/test_flashnorm_e2e.py
    MINILLM_LESSON_QUICK=1 MINILLM_LESSON_MODEL=${MINILLM_TEST_SMOLLM2:-random:smollm2-135m} \
        TAIL=16 step flashnorm 150 python3 lessons/15_flashnorm.py ;;
pdl)       # programmatic dependent launch: its tests, then decode tok/s with and without it (all formats)
    step pdl 200 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_cuda_pdl.py tests/test_pdl.py
    TAIL=14 step pdl 300 python3 -m minillm.cuda.dev.pdl ;;
qmma)
    TAIL=50 step qmma 240 python3 -m minillm.cuda.dev.qmma --decode
    step qmma 200 python3 -m pytest -q -n 4 -p no:cacheprovider -o addopts="" -k "v3 or mma" \
        tests/test_cuda_quant.py tests/test_qmma_emulation.py tests/test_kernels_compile.py ;;
qtma)      # the quantized GEMV v4 (weights streamed by the TMA): its checks, v2 vs v4 per matrix and in decode
    TAIL=60 step qtma 300 python3 -m minillm.cuda.dev.qtma --decode ;;
chain)     # the decode chain: what each kind of kernel adds inside it, the prefetches across its links
    step chain 100 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_cuda_pdl.py tests/test_chain.py
    TAIL=45 step chain 420 python3 -m minillm.cuda.dev.chain ${CHAIN_ARGS:-} ;;
widen)     # prefill's int8/int4 widening one GEMM ahead on a second stream: its tests, TTFT both ways
    step widen 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_cuda_widen_ahead.py tests/test_widen_ahead.py
    TAIL=16 step widen 300 python3 -m minillm.cuda.dev.widen ;;
ab)        # one KernelSettings change: bit for bit, then decode tok/s in alternating rounds
    TAIL=12 step ab 300 python3 -m minillm.cuda.dev.ab --set "${AB_SET:?ab needs AB_SET=name=value}" \
        --formats "${AB_FORMATS:-float16,int8,int4}" ;;
qfloor)
    TAIL=40 step qfloor 300 python3 -m minillm.cuda.dev.qfloor --decode ${QFLOOR_VARIANTS:+--variants "$QFLOOR_VARIANTS"} ;;
bprefill)  # paged_prefill_attention_mma: tests, µs a layer against the group kernel, the server with it on
    step bprefill 200 python3 -m pytest -q -n 4 -p no:cacheprovider -o addopts="" -k "prefill_mma or either_prefill" \
        tests/test_gpu_engine.py
    TAIL=20 step bprefill 150 python3 -m minillm.cuda.dev.paged_attention --prefill
    TAIL=10 step bprefill 240 python3 -m minillm bench serve --device cuda --random-weights \
        -m mistral-7b --requests 64 --concurrency 64 --workload random --prompt-len 128 --output-len 64 --rounds 3 ;;
bench)
    for q in "" int8 int4; do
        TAIL=22 step bench 150 python3 -m minillm bench --device cuda --random-weights -m mistral-7b --new-tokens 128 \
            --no-peer ${q:+--quant $q}
    done ;;
commit)
    TAIL=60 step commit 580 bash minillm/cuda/dev/ab_commit.sh ;;
serve)
    TAIL=10 step serve 200 python3 -m minillm bench serve --device cuda --random-weights -m mistral-7b --requests 64 \
        --concurrency 64 --workload random --prompt-len 128 --output-len 64 ;;
esac; done
echo "=== done $(date -u +%H:%M:%S)"
