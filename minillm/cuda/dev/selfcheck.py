"""Check, then time, the GPU path in one run:  python -m minillm.cuda.selfcheck [--quick]

A short driver over the dev modules: every kernel family's checks (elementwise, gemv, attention) in fp16
and bf16, small random models GPU vs CPU (dev/model.py), then the whole-model benchmark on a
Mistral-7B-shaped random model (dev/bench.py; `--quick`: a small one) and the same workload through HF
transformers. Ends with one line: all checks passed, or which failed (exit status 1).
"""
from __future__ import annotations

import argparse
import sys
import time

from minillm.cuda.dev import attention, elementwise, gemv
from minillm.cuda.dev.bench import bench, bench_config, bench_hf
from minillm.cuda.dev.common import finish, require_gpu, run_cases, say, verdict
from minillm.cuda.dev.model import model_checks
from minillm.cuda.dev.timing import BANDWIDTH

FAMILIES = (elementwise, gemv, attention)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minillm.cuda.selfcheck", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer checks and a small model (a first smoke run)")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"], help="benchmark weights")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=16, help="prompt length before the timed decode")
    ap.add_argument("--ttft-tokens", type=int, default=512)
    ap.add_argument("--no-bench", action="store_true", help="checks only")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers comparison (never run with --quick)")
    args = ap.parse_args(argv)
    if not require_gpu("selfcheck"):
        return 2
    import cupy as cp
    from minillm.cuda.dev.timing import device_name
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    say(f"minillm GPU selfcheck on {device_name()} (sm_{props['major']}{props['minor']}, {props['multiProcessorCount']} SMs, "
        f"{props['totalGlobalMem'] / 2**30:.0f} GiB), CuPy {cp.__version__}, CUDA runtime "
        f"{cp.cuda.runtime.runtimeGetVersion()}, {time.strftime('%Y-%m-%d')}")
    t0 = time.perf_counter()
    say("kernels vs NumPy (error relative to the reference's largest value; NaN-poisoned outputs)")
    for family in FAMILIES:
        run_cases(family.cases, quick=args.quick)
    model_checks(args.quick)
    say(f"(checks took {time.perf_counter() - t0:.1f} s, NVRTC compiles included)")
    if not args.no_bench:
        try:
            bench(args.quick, args.dtype, args.new_tokens, args.prompt, args.ttft_tokens)
        except Exception as e:  # noqa: BLE001 - a failed benchmark is a failed check, reported at the end
            import traceback
            traceback.print_exc()
            verdict("benchmark", False, f"raised {type(e).__name__}: {e}")
        if not (args.quick or args.no_hf):
            cp.get_default_memory_pool().free_all_blocks()       # our 7B model is gone: give HF the room
            try:
                bench_hf(bench_config(False), args.new_tokens, args.prompt, args.ttft_tokens, BANDWIDTH.get("copy"))
            except Exception as e:  # noqa: BLE001 - a missing torch/transformers is not a minillm failure
                say(f"\nHF transformers comparison skipped: {type(e).__name__}: {e}")
    say(f"\ntotal {time.perf_counter() - t0:.1f} s")
    return finish("selfcheck")


if __name__ == "__main__":
    sys.exit(main())
