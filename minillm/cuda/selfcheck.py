"""`python -m minillm.cuda.selfcheck [--quick]`: the shipped GPU path checked against the CPU model, then timed.

Small random models (each attention shape, fp16/bf16, int8/int4 weights, the int8 KV cache) on the GPU and the CPU,
same weights: logits within MODEL_TOL, greedy tokens equal (or parted at a near-tie), graph replay == eager bit for
bit; then TTFT and decode tok/s on the Mistral-7B shape (`--quick`: a small one). The last line: all passed, or
which failed (exit 1). Its check runner is the dev modules' too (every kernel vs NumPy: minillm.cuda.dev.selfcheck).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from functools import partial

import numpy as np

from minillm.backend import to_dtype
from minillm.checkpoints.quantize import quantize_checkpoint
from minillm.cuda.gpu_model import GPUTransformer     # the checks' GPU model (no CuPy import); the lab passes its own
from minillm.cuda.timing import copy_bandwidth, decode_bytes, decode_tok_s, device_name, prefill_ttft
from minillm.model.config import PRESETS, ModelConfig
from minillm.model.transformer import Transformer

SHORT = {"float16": "fp16", "bfloat16": "bf16"}
# Model-level tolerance, relative to the largest |logit|: the GPU narrows activations to 16 bits before
# each prefill GEMM and keeps K/V in 16 bits; the CPU does neither.
MODEL_TOL = {"float16": 5e-3, "bfloat16": 3e-2}     # seen in a CPU emulation: 6e-4 and 4e-3
say = partial(print, flush=True)          # one line of a run's report, out at once
FAILED: list[str] = []          # the names of the checks that failed in this run (the selfcheck, dev modules)
QUICK_SHAPE = ModelConfig(vocab_size=8000, dim=1024, n_layers=4, n_heads=16, n_kv_heads=4, ffn_dim=2816,
                          max_seq_len=4096, family="mistral", sliding_window=4096)


def verdict(name: str, passed: bool, detail: str) -> None:
    say(f"  {'PASS' if passed else 'FAIL'}  {name:<52} {detail}")
    if not passed:
        FAILED.append(name)


def guarded(name: str, fn) -> None:
    """Run one check; an exception is a failed check, not the end of the run."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - report and go on
        verdict(name, False, f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")


def finish(prog: str) -> int:
    """The last line of a run: all passed (0) or which failed (1)."""
    say(f"{prog}: {len(FAILED)} FAILED: {', '.join(FAILED)}" if FAILED else f"{prog}: all checks passed")
    return 1 if FAILED else 0


def require_gpu(prog: str) -> bool:
    """True when a GPU can be used; else one line on stderr saying why."""
    from minillm.cuda import available
    if available():
        return True
    print(f"{prog}: no CUDA device (or no CuPy): run this on the GPU machine", file=sys.stderr)
    return False


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """The largest absolute difference over the reference's largest magnitude (inf for NaN or a shape mismatch)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape or np.isnan(got).any():
        return math.inf                        # NaN: a poisoned element was never written
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def small_config(kind: str = "gqa", **changes) -> ModelConfig:
    """Small random-model shapes: "gqa", "mha", "mqa", "tied", "mistral" (sliding window 6), "hd64", "llama3",
    "hd192" (heads the tiled prefill kernel does not take: its fallback runs)."""
    base = dict(vocab_size=512, dim=128, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=256,
                norm_eps=1e-5, rope_theta=10000.0, max_seq_len=128)
    base |= {"gqa": {}, "mha": dict(n_kv_heads=8), "mqa": dict(n_kv_heads=1),
             "tied": dict(tie_embeddings=True, n_layers=3),
             "mistral": dict(family="mistral", sliding_window=6),
             "hd64": dict(dim=256, n_heads=4, n_kv_heads=2, ffn_dim=512),
             "hd192": dict(dim=384, n_heads=2, n_kv_heads=1, ffn_dim=768),
             "llama3": dict(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 32})}[kind]
    return ModelConfig(**(base | changes))


def bench_config(quick: bool) -> ModelConfig:
    """The timed shape: Mistral-7B's, or (quick) a small Mistral-like one."""
    return QUICK_SHAPE if quick else PRESETS["mistral-7b"].config


def random_cpu_model(config: ModelConfig, dtype: str = "float16", seed: int = 0, quant: str | None = None,
                     group_size: int = 128) -> Transformer:
    """A CPU Transformer with random weights already rounded to `dtype`, so the CPU and the GPU
    multiply the same numbers (norm gains stay fp32, as the GPU keeps them). quant: the layer
    matrices then quantized by minillm.model.quant (int8 / int4 in groups of `group_size`), as load() does."""
    rng = np.random.default_rng(seed)
    c, hd = config, config.head_dim
    narrow = lambda a: to_dtype(np.asarray(a, np.float32), dtype)     # the 16-bit storage the GPU holds
    mat = lambda rows, cols: narrow(rng.standard_normal((rows, cols)) / math.sqrt(cols))
    gain = lambda: (1 + 0.1 * rng.standard_normal(c.dim)).astype(np.float32)
    t = {"model.embed_tokens.weight": narrow(rng.standard_normal((c.vocab_size, c.dim))), "model.norm.weight": gain()}
    if not c.tie_embeddings:
        t["lm_head.weight"] = mat(c.vocab_size, c.dim)
    shapes = {"self_attn.q_proj": (c.n_heads * hd, c.dim), "self_attn.k_proj": (c.n_kv_heads * hd, c.dim),
              "self_attn.v_proj": (c.n_kv_heads * hd, c.dim), "self_attn.o_proj": (c.dim, c.n_heads * hd),
              "mlp.gate_proj": (c.ffn_dim, c.dim), "mlp.up_proj": (c.ffn_dim, c.dim),
              "mlp.down_proj": (c.dim, c.ffn_dim)}
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": gain(), p + "post_attention_layernorm.weight": gain()}
        t |= {f"{p}{name}.weight": mat(*shape) for name, shape in shapes.items()}
    if quant is not None:
        config, t = quantize_checkpoint(config, t, quant, group_size)
    return Transformer(config, t)


def check_model_logits(kind: str, dtype: str, n_prompt: int = 12, n_decode: int = 20, seed: int = 0,
                       quant: str | None = None, group_size: int = 128, cpu=None, kv_cache: str = "auto",
                       make_gpu=GPUTransformer.from_cpu):
    """Prefill logits (all positions) and teacher-forced decode logits, GPU vs CPU. -> (error, tolerance). quant:
    int8/int4 layer matrices; cpu: a CPU model instead of a random one; kv_cache "int8": both sides quantize K and V."""
    cpu = (cpu or random_cpu_model(small_config(kind), dtype, seed, quant, group_size)).with_options(kv_cache=kv_cache)
    gpu = make_gpu(cpu, dtype, kv_cache=kv_cache)
    ids = np.random.default_rng(seed + 1).integers(0, cpu.config.vocab_size, n_prompt + n_decode)
    err = rel_err(gpu.prefill(ids[:n_prompt], gpu.new_cache(64), all_logits=True),
                  cpu.prefill(ids[:n_prompt], cpu.new_cache(64), all_logits=True))
    cc, gc = cpu.new_cache(64), gpu.new_cache(64)
    err = max(err, rel_err(gpu.prefill(ids[:n_prompt], gc), cpu.prefill(ids[:n_prompt], cc)))
    for t in ids[n_prompt:]:
        err = max(err, rel_err(gpu.decode(int(t), gc), cpu.decode(int(t), cc)))
    return err, MODEL_TOL[dtype]


def greedy(model, prompt, n: int, cache) -> tuple[list[int], list[np.ndarray]]:
    logits = model.prefill(prompt, cache)
    tokens, all_logits = [], []
    for _ in range(n):
        all_logits.append(logits)
        tokens.append(int(np.argmax(logits)))
        logits = model.decode(tokens[-1], cache)
    return tokens, all_logits


def check_greedy(kind: str, dtype: str, n: int = 16, seed: int = 0, quant: str | None = None, group_size: int = 128,
                 cpu=None, prompt=None, kv_cache: str = "auto", make_gpu=GPUTransformer.from_cpu):
    """Greedy continuations, GPU vs CPU. -> (tokens equal, detail). A divergence is accepted only at a
    near-tie: where the CPU's top two logits are closer than the logits' measured error."""
    cpu = (cpu or random_cpu_model(small_config(kind), dtype, seed, quant, group_size)).with_options(kv_cache=kv_cache)
    gpu = make_gpu(cpu, dtype, kv_cache=kv_cache)
    prompt = np.random.default_rng(seed + 1).integers(0, cpu.config.vocab_size, 8) if prompt is None else prompt
    want, cpu_logits = greedy(cpu, prompt, n, cpu.new_cache(64))
    got, gpu_logits = greedy(gpu, prompt, n, gpu.new_cache(64))
    for i, (a, b) in enumerate(zip(want, got)):
        if a != b:
            top2 = np.sort(cpu_logits[i])[-2:]
            margin, err = float(top2[1] - top2[0]), float(np.abs(cpu_logits[i] - gpu_logits[i]).max())
            return margin < 2 * err, f"diverged at token {i}: cpu {a} gpu {b}, top-2 margin {margin:.2e}, " \
                                     f"logit error {err:.2e}"
    return True, f"{n} tokens equal"


def check_graph_equals_eager(kind: str, dtype: str, n: int = 24, seed: int = 0, quant: str | None = None,
                             group_size: int = 128, kv_cache: str = "auto", make_gpu=GPUTransformer.from_cpu):
    """The same prompt and tokens through eager launches and through the replayed CUDA graph: the same
    kernels in the same order, so the logits must be bit-identical. -> (equal, detail)"""
    cfg = small_config(kind)
    gpu = make_gpu(random_cpu_model(cfg, dtype, seed, quant, group_size), dtype, kv_cache=kv_cache)
    ids = np.random.default_rng(seed + 1).integers(0, cfg.vocab_size, 8 + n)
    runs = []
    for use_graph in (False, True):
        run = gpu.with_options(use_graph=use_graph)
        cache = run.new_cache(64)
        runs.append(np.stack([run.prefill(ids[:8], cache)] + [run.decode(int(t), cache) for t in ids[8:]]))
    same = bool(np.array_equal(runs[0], runs[1]))
    return same, "bit-identical" if same else f"max diff {np.abs(runs[0] - runs[1]).max():.3e}"


def within(label: str, check) -> None:
    """A PASS/FAIL line for check() -> (error, tolerance) or (passed, detail); an exception fails it too."""
    def one():
        a, b = check()
        passed, detail = (a <= b, f"err {a:.2e}  tol {b:.1e}") if isinstance(b, float) else (a, b)
        verdict(label, passed, detail)
    guarded(label, one)


def model_checks(quick: bool) -> None:
    say("small random models, GPU vs CPU (same 16-bit weights on both)")
    kinds = ["gqa", "mistral"] if quick else ["gqa", "mha", "mqa", "tied", "mistral", "hd64", "llama3", "hd192"]
    for dtype in ("float16", "bfloat16"):
        for kind in kinds:
            within(f"{SHORT[dtype]} logits {kind}", lambda: check_model_logits(kind, dtype))
        for kind in ("gqa", "mistral"):
            for what, change in (("int8 weights", {"quant": "int8"}), ("int4 weights", {"quant": "int4"}),
                                 ("int8 KV cache", {"kv_cache": "int8"})):
                within(f"{SHORT[dtype]} logits {kind} {what}", lambda: check_model_logits(kind, dtype, **change))
    for kind in ("gqa", "mistral"):
        within(f"fp16 greedy 16 tokens {kind}", lambda: check_greedy(kind, "float16"))
        within(f"fp16 graph replay == eager {kind}", lambda: check_graph_equals_eager(kind, "float16"))


def timing(quick: bool, prompt_len: int = 16, n_new: int = 128, ttft_len: int = 512) -> None:
    """The shipped path on random fp16 weights of bench_config's shape, batch 1: TTFT, decode tok/s with the CUDA
    graph and eager (their tokens must agree), bytes per token, GB/s and % of the copy bandwidth."""
    cfg, bw = bench_config(quick), copy_bandwidth((256 if quick else 2048) << 20)
    gpu = GPUTransformer.random(cfg, "float16", seed=0)
    cache = gpu.new_cache(max(ttft_len, prompt_len + n_new) + 8)
    rng = np.random.default_rng(0)
    ttft = prefill_ttft(gpu, cache, rng.integers(0, cfg.vocab_size, ttft_len))
    short = rng.integers(0, cfg.vocab_size, prompt_len)
    (tps, tokens), (eager, eager_tokens) = (decode_tok_s(model, cache, short, n_new)
                                            for model in (gpu, gpu.with_options(use_graph=False)))
    per_token, _ = decode_bytes(cfg, gpu.weight_bytes, prompt_len, n_new)
    say(f"\n{'small (--quick)' if quick else 'Mistral-7B'} shape, random fp16 weights, batch 1: TTFT {ttft_len} tokens "
        f"{ttft * 1e3:.1f} ms; decode {tps:.1f} tok/s with the CUDA graph ({eager:.1f} eager), {per_token / 1e9:.3f} "
        f"GB a token: {per_token * tps / 1e9:.0f} GB/s, {100 * per_token * tps / bw:.0f}% of the copy bandwidth")
    verdict("decode: graph tokens == eager tokens", tokens == eager_tokens, "" if tokens == eager_tokens else
            "the graph replay diverged from eager launches")
    say("the full tables and HF transformers beside: minillm bench --device cuda --random-weights --model mistral-7b")


def main(argv=None, checks=model_checks, prog: str = "python -m minillm.cuda.selfcheck") -> int:
    """The selfcheck: `checks(quick)` (the lab passes its longer list), then the timing."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer checks and a small model (a first smoke run)")
    ap.add_argument("--no-bench", action="store_true", help="checks only, no timing")
    args = ap.parse_args(argv)
    if not require_gpu("selfcheck"):
        return 2
    import cupy as cp
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    say(f"minillm GPU selfcheck on {device_name()} (sm_{props['major']}{props['minor']}, {props['multiProcessorCount']} SMs, "
        f"{props['totalGlobalMem'] / 2**30:.0f} GiB), CuPy {cp.__version__}, CUDA runtime "
        f"{cp.cuda.runtime.runtimeGetVersion()}, {time.strftime('%Y-%m-%d')}")
    t0 = time.perf_counter()
    checks(args.quick)
    say(f"(checks took {time.perf_counter() - t0:.1f} s, NVRTC compiles included)")
    if not args.no_bench:
        guarded("timing", lambda: timing(args.quick))
    say(f"\ntotal {time.perf_counter() - t0:.1f} s")
    return finish("selfcheck")


if __name__ == "__main__":
    sys.exit(main())
