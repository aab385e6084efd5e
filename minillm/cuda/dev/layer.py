"""A decoder layer's four quantized GEMVs as one kernel (kernels/gemv_layer.cuh), against the engine's four
launches.

The lever the decode chain's measurements pointed to (lessons/BENCHMARKS.md, issue 24): fewer launch
boundaries. The experiment keeps every GEMV's code and arguments and changes only what separates them: a
grid barrier inside one resident grid instead of a kernel boundary bridged by programmatic dependent launch.
Decode attention, which sits between qkv and o, is left out of both sides (dev.chain's "without attention"):

    check   greedy logits of the step with the layer kernels equal the engine's step without attention, bit
            for bit (the same pairs computed by the same code: only the barrier between them changed)
    time    decode tok/s: the engine's full step, its step without attention, and the layer kernels, in
            alternating rounds (int8 and int4 weights; Mistral-7B shape, random weights)

    python -m minillm.cuda.dev.layer [--quick] [--rounds N] [--new-tokens N]

Importing this module does not import CuPy.
"""
from __future__ import annotations

import sys

import numpy as np

from minillm.cuda.dev.bench import decode_bytes, decode_sweep_setup, sweep_parser
from minillm.cuda.dev.chain import kind_of, leaving_out, median_tok_s, same_numbers
from minillm.cuda.dev.common import finish, plain_table, require_gpu

PHASES = ("qkv", "o", "gate_up", "down")          # the layer kernel's phases, in order
WORDS = 24                                        # 64-bit words a phase (LAYER_ARGS)
DEFINES = ("-DQ_X_COHERENT=1",)
FILES = ("gemv_quant.cu", "gemv_layer.cuh")       # the layer kernels are gemv_quant.cu's code


def layer_source() -> str:
    """gemv_quant.cu and gemv_layer.cuh as one source, each header pasted once."""
    from minillm.cuda.kernels import KERNEL_DIR, _paste_includes
    seen: set = set()
    text = "\n".join(_paste_includes((KERNEL_DIR / name).read_text(), seen) for name in FILES)
    return text.replace("#pragma once\n", "")


def as_words(args, floats=()) -> list[int]:
    """Launch arguments as 64-bit words: device arrays as their addresses, the arguments at `floats` as their
    float32 bits, integers as themselves."""
    words = []
    for i, a in enumerate(args):
        if hasattr(a, "data") and hasattr(a.data, "ptr"):
            words.append(int(a.data.ptr))
        elif i in floats:
            words.append(int(np.float32(a).view(np.uint32)))
        else:
            words.append(int(a) & 0xFFFFFFFFFFFFFFFF)
    return words


def phase_words(launch: tuple) -> list[int]:
    """One recorded GEMV launch (name, grid, block, args, label, shared memory) as its phase's WORDS words:
    its first 24 arguments (Kernels._quant_args; eps is argument 9)."""
    return as_words(launch[3][:WORDS], floats=(9,))


def plan_step(launches: list[tuple]) -> list[tuple]:
    """The recorded launches of one engine step (attention already left out) -> the layer-kernel step: each
    layer's four GEMVs become ("layer", [4 x WORDS words], the widest shared memory); every other launch
    (embed, the head) stays as it was. Refuses a step whose GEMVs do not come in the phases' order."""
    step, i = [], 0
    while i < len(launches):
        kind = kind_of(launches[i][0], launches[i][4])
        if kind != "qkv":
            if kind in PHASES:
                raise ValueError(f"a {kind} GEMV outside a layer's run of {', '.join(PHASES)}")
            step.append(launches[i])
            i += 1
            continue
        group = launches[i:i + len(PHASES)]
        kinds = tuple(kind_of(g[0], g[4]) for g in group)
        if kinds != PHASES:
            raise ValueError(f"a layer's launches: {kinds}, expected {PHASES}")
        step.append(("layer", sum((phase_words(g) for g in group), []), max(g[5] for g in group)))
        i += len(PHASES)
    return step


def layer_kernel_model(gpu, method: str):
    """A copy of the quantized gpu whose decode step runs a layer kernel a layer, attention left out."""
    import cupy as cp
    from minillm.cuda import pdl
    from minillm.cuda.kernels import _capturing
    mod = cp.RawModule(code=layer_source(), options=("--std=c++17",) + DEFINES)
    fn = mod.get_function(f"gemv_layer_{method}")
    fn.max_dynamic_shared_size_bytes = gpu.k.max_quant_smem - fn.attributes["shared_size_bytes"]   # beside its static
    grid, block = (2 * gpu.k.n_sms,), (256,)
    other = leaving_out(gpu, ("attention",))
    bar = cp.zeros(2, cp.uint32)
    plans: dict[int, tuple] = {}

    def recorded(cache) -> list[tuple]:
        """The launches the engine's step on `cache` would make, recorded (none made)."""
        calls = []
        recorder = gpu.with_settings()
        recorder.k._launch = lambda name, g, b, args, label="", shared_mem=0: calls.append(
            (name, g, b, args, label, shared_mem))
        leaving_out(recorder, ("attention",)).decode_step(cache)
        return calls

    def decode(token, cache, n_layers=None):
        if id(cache) not in plans:                   # the arguments name this cache's buffers; uploaded here,
            step = plan_step(recorded(cache))                 # not while decode_step is captured
            words = [cp.asarray(np.array(s[1], dtype=np.uint64)) for s in step if s[0] == "layer"]
            plans[id(cache)] = step, words
        return type(other).decode(other, token, cache, n_layers)

    def decode_step(cache, n_layers=None):
        step, words = plans[id(cache)]
        layer = iter(words)
        for s in step:
            if s[0] != "layer":
                other.k._launch(*s)
                continue
            args = (next(layer), bar)
            if gpu.settings.pdl and _capturing():
                pdl.launch(fn, grid, block, args, s[2])
            else:
                fn(grid, block, args, shared_mem=s[2])
    other.decode, other.decode_step = decode, decode_step
    return other


def main(argv=None) -> int:
    ap = sweep_parser("layer", __doc__)
    args = ap.parse_args(argv)
    if not require_gpu(ap.prog):
        return 2
    import cupy as cp
    from minillm.cuda.gpu_model import GPUTransformer
    cfg, bw, prompt = decode_sweep_setup(args.quick)
    rows = []
    for method in ("int8", "int4"):
        gpu = GPUTransformer.random(cfg, "float16", seed=0, quant=method)
        models = {"engine, full step": gpu, "engine without attention": leaving_out(gpu, ("attention",)),
                  "layer kernels without attention": layer_kernel_model(gpu, method)}
        same_numbers(models["engine without attention"], models["layer kernels without attention"], prompt,
                     f"layer kernel {method}")
        cache = gpu.new_cache(len(prompt) + args.new_tokens + 8)
        tps = median_tok_s(models, cache, prompt, args.new_tokens, args.rounds)
        per_token, _ = decode_bytes(cfg, gpu.weight_bytes, len(prompt), args.new_tokens)
        base = tps["engine without attention"]
        for label, t in tps.items():
            rows.append([method, label, f"{t:.1f}", f"{1e6 / t:.0f}", f"{100 * per_token * t / bw:.0f}%",
                         f"{t / base:.3f}x"])
        del gpu, models, cache
        cp.get_default_memory_pool().free_all_blocks()
    plain_table(f"\ndecode, batch 1, {args.new_tokens} new tokens, CUDA graph, median of {args.rounds} alternating "
                "rounds", ["weights", "step", "tok/s", "µs a token", "% of copy", "vs the engine without attention"],
                rows)
    return finish(ap.prog)


if __name__ == "__main__":
    sys.exit(main())
