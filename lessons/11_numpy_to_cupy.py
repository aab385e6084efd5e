"""Lesson 11 — from NumPy to CuPy: what moves to the GPU, what stays on the host, and what crossing costs.

Up to now every array lived in host memory and NumPy ran on the CPU. A GPU computes from its own
memory (141 GB of HBM3e at ~4.3 TB/s on an H200) at the far end of a bus that is ~100x slower (PCIe or
NVLink-C2C, tens of GB/s). So the first question of a GPU port is where each array lives:

    moves to the device, once:  the weights (fp16, 2 bytes a weight; the norm gains stay fp32)
    made on the device:         the KV cache and every activation buffer: nothing crosses the bus
    crosses at every token:     the token id and its position up (8 bytes), the logits down (vocab × 4 B)
    stays on the host:          the tokenizer, the sampler, the generate loop, stop strings

CuPy is NumPy's API over device arrays, and NumPy hands `np.exp(x)`, `np.concatenate(...)` to CuPy when
x is a CuPy array (NEP 13 and 18); what it cannot hand over is making a new array (np.arange, np.zeros).
So the engine's model asks `backend.array_module(x)` wherever it makes one (positions, masks, caches),
and its own layers, attention and KV cache run unchanged on the GPU once their arrays are CuPy arrays:
that change is this lesson's NEW part. We measure the bus, run the engine's Transformer that way,
then the engine's GPUTransformer (fp16, hand-written kernels, a CUDA graph), and compare both with the
CPU model's logits. Lessons 12 and 13 explain the difference in speed between the two.

Run: python lessons/11_numpy_to_cupy.py      (MINILLM_LESSON_QUICK=1 for a smoke run)
Without a GPU the lesson runs its CPU parts and lists the GPU measurements it skipped.
"""
ABOUT = {                   # `minillm lesson N --about` prints this (minillm/course/lessons.py)
    "prerequisites": [
        "lesson 03 (bytes and bandwidth)",
        "what a GPU is: many threads, its own memory",
    ],
    "objectives": [
        "list which arrays cross the bus once and which cross every token, and their bytes",
        "run the engine's NumPy model on CuPy arrays unchanged and see why it is slow",
        "measure host-device copies, pageable vs pinned (on a GPU)",
    ],
    "study_time": "45 min, plus 20 min for exercise 11 (bytes over the bus)",
    "check_questions": [
        "Which bytes cross the bus per decoded token, and why so few?",
        "Why is NumPy code on CuPy arrays correct but slow?",
    ],
    "try_this": [
        "on a GPU machine: pip install -e \".[gpu]\" and run the GPU part",
        "change n_new and check the per-token bytes do not grow",
    ],
}
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

import numpy as np

from minillm.course.measure import Spread, interleaved, load_line
from minillm.course import lesson_model, print_table, quick, run_gpu_parts, transfer_bytes_reference, why_no_gpu
from minillm.model.transformer import Transformer
from minillm.engine.sampling import Sampler, SamplingParams


# NEW: where each array lives, and what crosses the bus ------------------------------------------------
def upload_bytes(model: Transformer, weight_bytes: int = 2) -> int:
    """Bytes GPUTransformer.from_cpu copies to the device, counted from the model's own arrays: every
    matrix at weight_bytes, the norm gains as fp32, a tied LM head once (it is the embedding)."""
    total = model.embed.size * weight_bytes + model.final_norm.size * 4
    if model.lm_head is not model.embed:
        total += model.lm_head.size * weight_bytes
    for L in model.layers:
        total += sum(w.size for w in (L.wq, L.wk, L.wv, L.wo, L.w_gate, L.w_up, L.w_down)) * weight_bytes
        total += (L.attn_norm.size + L.mlp_norm.size) * 4
    return total


def decode_buffer_bytes(cfg) -> int:
    """The fp32 activation buffers GPUTransformer allocates once on the device for the decode step:
    residual x, normed h, qkv, attention out, gate|up, SwiGLU out, logits."""
    qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    return 4 * (2 * cfg.dim + qkv + cfg.n_heads * cfg.head_dim + 3 * cfg.ffn_dim + cfg.vocab_size)


def host_us(fn, repeats: int) -> str:
    """µs of fn(): median (min-max) over `repeats` runs (course/measure.py)."""
    return interleaved({"fn": fn}, repeats)["fn"].format(1e6, 0)
# -------------------------------------------------------------------------------------------------------


# NEW: the backend change: the engine's own Transformer on CuPy arrays -----------------------------------
# minillm/backend.py gained one function, and every line of the model that MAKES an array asks it which
# module to make it with (`xp = array_module(x)`: numpy, or cupy for a CuPy x). Arithmetic needs no
# change (NumPy hands np.exp(x) to CuPy for a CuPy x); only creation does (np.arange, np.zeros, np.empty,
# a mask from np.where): CuPy refuses to mix a host array into device arithmetic, a hidden copy each time.
#
#     def array_module(*arrays):
#         cupy = sys.modules.get("cupy")                 # never imported here: CPU installs need no CuPy
#         if cupy is not None and any(isinstance(a, cupy.ndarray) for a in arrays):
#             return cupy
#         return np
#
#     positions = xp.arange(cache.length, cache.length + len(tokens))     # transformer.forward
#     q_pos = xp.arange(first_query, first_query + n_queries)[:, None]    # attention._allowed: the mask
#     self.k = xp.zeros(shape, dtype=dtype)                               # KVCache: made on the device
#
# and the logits come back with backend.to_host. So "running on the GPU" is moving the arrays, nothing
# more: minillm/cuda/device_model.to_device copies the weights (q|k|v and gate|up stay single stacks,
# the separate names views of them) and hands back the same Transformer class.
def backend_lines() -> list[tuple[str, int, str]]:
    """Where the model code asks for its array module: (file, line, code), read from the engine's sources."""
    import minillm.model
    out = []
    for path in sorted(Path(minillm.model.__file__).parent.glob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if "array_module(" in line and not line.lstrip().startswith(("def ", "#", "from ")):
                out.append((path.name, n, line.strip()))
    return out


def cupy_transformer(cpu: Transformer) -> Transformer:
    """The engine's Transformer with every array copied to the GPU in fp32, as on the CPU: no method rewritten."""
    from minillm.cuda.device_model import to_device
    return to_device(cpu, "float32", cache_dtype="float32")
# -------------------------------------------------------------------------------------------------------


def cpu_reference(model, prompt: list[int], n_new: int) -> tuple[list[int], list[np.ndarray], list[float]]:
    """Greedy decoding on the CPU engine: (tokens fed after the prompt, logits after the prompt and after
    each of them, seconds per decode step). The GPU runs are fed the same tokens and compared step by step."""
    cache = model.new_cache(len(prompt) + n_new + 1)
    logits = [model.prefill(prompt, cache)]
    tokens, times = [], []
    for _ in range(n_new):
        tokens.append(int(np.argmax(logits[-1])))
        start = time.perf_counter()
        logits.append(model.decode(tokens[-1], cache))
        times.append(time.perf_counter() - start)
    return tokens, logits, times


def compare(got: list[np.ndarray], want: list[np.ndarray]) -> tuple[float, float, int]:
    """(max |Δ logit|, that relative to the largest |logit|, steps whose top-1 token agrees)."""
    err = max(float(np.abs(g - w).max()) for g, w in zip(got, want))
    scale = max(float(np.abs(w).max()) for w in want)
    agree = sum(int(np.argmax(g) == np.argmax(w)) for g, w in zip(got, want))
    return err, err / scale, agree


def main():
    small = quick()
    llm = lesson_model()
    model, cfg = llm.model, llm.config
    n_new = 4 if small else 16
    context = cfg.max_seq_len
    prompt = llm.prompt_ids("The capital of France is", chat=False)

    # 1. Where every array of the model lives on the GPU path, and which bytes cross the bus.
    up_counted = upload_bytes(model)
    upload, up_step, down_step = transfer_bytes_reference(cfg)            # exercise 11's answer
    layer_bytes = sum(w.size for L in model.layers for w in (L.wq, L.wk, L.wv, L.wo, L.w_gate, L.w_up, L.w_down)) * 2
    norm_bytes = (2 * cfg.n_layers + 1) * cfg.dim * 4
    tied = model.lm_head is model.embed
    kv_bytes = cfg.kv_bytes_per_token(2) * context
    print_table(f"Lesson 11 — where each array of the model lives on the GPU path ({cfg.n_layers} layers, "
                f"dim {cfg.dim}, vocab {cfg.vocab_size:,})",
                ["what", "where", "bytes", "crosses the bus"],
                [[f"layer matrices (q, k, v, o, gate, up, down) x {cfg.n_layers}", "device, fp16",
                  f"{layer_bytes:,}", "once, at load"],
                 [f"embedding [{cfg.vocab_size}, {cfg.dim}]" + (" = the tied LM head" if tied else " + LM head"),
                  "device, fp16", f"{model.embed.size * 2 * (1 if tied else 2):,}", "once, at load"],
                 [f"RMSNorm gains, {2 * cfg.n_layers + 1} x [{cfg.dim}]", "device, fp32", f"{norm_bytes:,}",
                  "once, at load"],
                 [f"KV cache for {context:,} positions", "made on the device, fp16", f"{kv_bytes:,}", "never"],
                 ["decode buffers (x, qkv, attention, gate|up, logits)", "made on the device, fp32",
                  f"{decode_buffer_bytes(cfg):,}", "never"],
                 ["token id + position", "host -> device", f"{up_step}", "every token"],
                 [f"logits [{cfg.vocab_size}] fp32", "device -> host", f"{down_step:,}", "every token"],
                 ["tokenizer, sampler, generate loop, stop strings", "host (Python)", "-", "never"]])
    print(f"upload counted from the model's arrays: {up_counted:,} bytes; exercise 11's formula "
          f"(course.transfer_bytes_reference): {upload:,} bytes: {'match' if up_counted == upload else 'MISMATCH'}")

    lines = backend_lines()
    print_table(f"the backend change: {len(lines)} lines of the model ask backend.array_module which module "
                f"makes their arrays", ["file", "line", "code"], [[f, str(n), code[:90]] for f, n, code in lines])

    # 2. What stays on the host, measured here: the work per token that never goes to the GPU.
    tokens, cpu_logits, cpu_times = cpu_reference(model, prompt, n_new)
    logits = cpu_logits[0]
    reps = 5 if small else 50
    top_p = Sampler(SamplingParams(temperature=0.8, top_p=0.9, seed=0))
    stream = llm.tokenizer.stream_decoder()
    cpu_ms = 1e3 * statistics.median(cpu_times)
    sampling_us = host_us(lambda: top_p(logits), reps)
    host_rows = [["greedy: argmax over the logits", host_us(lambda: np.argmax(logits), reps)],
                 ["temperature 0.8 + top-p 0.9 (sort of the vocab)", sampling_us],
                 ["tokenizer: one token to text (stream decoder)", host_us(lambda: stream.push(tokens[0]), reps)],
                 ["for scale: one decode step of the CPU engine (fp32)",
                  Spread(tuple(cpu_times)).format(1e6, 0)]]
    print_table(f"what stays on the host, per token, measured on this CPU (µs: median (min-max) of {reps}; vocab "
                f"{cfg.vocab_size:,})", ["work", "µs"], host_rows)
    print(load_line())

    # 3. The GPU: the bus, the upload, the engine's code through CuPy, GPUTransformer.
    state, results = {}, {}

    def bus():
        from minillm.cuda.timing import copy_bandwidth
        sizes = [8, cfg.vocab_size * 4, 16 << 20] + ([] if small else [256 << 20])
        rows = []
        for n in sizes:
            reps = 20 if n < (1 << 20) else (3 if small else 5)
            (up_p, down_p), (up_q, down_q) = copy_us(n, False, reps), copy_us(n, True, reps)
            rows.append([f"{n:,}"] + [f"{t:,.1f}  ({n / t / 1e3:,.2f})" for t in (up_p, up_q, down_p, down_q)])
            state["h2d pageable GB/s"] = n / up_p / 1e3
        print_table("host <-> device copies: µs per copy (GB/s), median; pageable = ordinary NumPy memory, "
                    "pinned = page-locked (cupyx.empty_pinned)",
                    ["bytes", "up, pageable", "up, pinned", "down, pageable", "down, pinned"], rows)
        d2d = copy_bandwidth((64 if small else 1024) << 20)
        state["d2d"] = d2d
        print(f"for contrast, a copy inside device memory: {d2d / 1e12:.2f} TB/s (read + write). A small copy "
              f"costs its latency, not its bytes: compare the 8-byte step buffer with the {down_step:,}-byte logits.")

    def upload_part():
        import cupy as cp
        from minillm.cuda.gpu_model import GPUTransformer
        start = time.perf_counter()
        gpu = GPUTransformer.from_cpu(model, dtype="float16")
        cp.cuda.Device().synchronize()
        seconds = time.perf_counter() - start
        held = {id(a): a for L in gpu.layers for a in (L.attn_norm, L.wqkv, L.wo, L.mlp_norm, L.w_gate_up, L.w_down)}
        held.update({id(a): a for a in (gpu.embed, gpu.lm_head, gpu.final_norm)})
        on_device = sum(a.nbytes for a in held.values())
        start = time.perf_counter()
        cache = gpu.new_cache(context)
        cp.cuda.Device().synchronize()
        cache_ms = 1e3 * (time.perf_counter() - start)
        state["gpu"] = gpu
        bus_rate = state.get("h2d pageable GB/s")
        print_table("GPUTransformer.from_cpu(model, 'float16') and its KV cache",
                    ["what", "value"],
                    [["weights held on the device", f"{on_device:,} bytes"],
                     ["exercise 11's upload formula",
                      f"{upload:,} bytes ({'match' if on_device == upload else 'MISMATCH'})"],
                     ["from_cpu wall time (host fp16 cast + q|k|v, gate|up stacking + copies)", f"{seconds:.2f} s"],
                     ["the copies alone at the pageable rate measured above",
                      f"{upload / (bus_rate * 1e9):.3f} s" if bus_rate else "(the bus part did not run)"],
                     [f"new_cache({context:,}): made on the device, 0 bytes over the bus",
                      f"{cache.nbytes:,} bytes in {cache_ms:.1f} ms"]])
        del cache

    def through_cupy():
        import cupy as cp
        if model.layers[0].wqkv is None:
            print("  skipped: this part needs plain float weights (int8/int4 ones stay on the host)")
            return
        start = time.perf_counter()
        port = cupy_transformer(model)
        cp.cuda.Device().synchronize()
        sent = sum(a.nbytes for a in {id(a): a for a in port.weights_read_per_token() + [port.embed]}.values())
        print(f"  the engine's Transformer on the device: {sent:,} bytes of fp32 weights sent in "
              f"{time.perf_counter() - start:.2f} s; a {type(port).__name__} whose embedding is a "
              f"{type(port.embed).__module__.split('.')[0]} array")
        cache = port.new_cache(len(prompt) + n_new + 1)
        got, times = [port.prefill(prompt, cache)], []                   # the causal mask is made with cupy
        for t in tokens:
            start = time.perf_counter()
            got.append(port.decode(t, cache))                            # host logits: [vocab] fp32
            times.append(time.perf_counter() - start)
        results["cupy"] = (1e3 * statistics.median(times), *compare(got, cpu_logits))
        del port, cache
        cp.get_default_memory_pool().free_all_blocks()

    def engine_gpu():
        import cupy as cp
        from minillm.cuda.gpu_model import GPUTransformer
        gpu = state.get("gpu") or GPUTransformer.from_cpu(model, dtype="float16")
        cache = gpu.new_cache(len(prompt) + n_new + 1)
        for attempt in ("warm-up (captures the CUDA graph)", "timed"):
            cache.reset()
            got, times = [gpu.prefill(prompt, cache)], []
            for t in tokens:
                start = time.perf_counter()
                got.append(gpu.decode(t, cache))                             # host fp32 logits
                times.append(time.perf_counter() - start)
        results["gpu"] = (1e3 * statistics.median(times), *compare(got, cpu_logits))
        del gpu, cache
        state.pop("gpu", None)
        cp.get_default_memory_pool().free_all_blocks()

    failed = run_gpu_parts([("the bus: host <-> device copies, pageable and pinned", bus),
                            ("the upload: GPUTransformer.from_cpu and a KV cache made on the device", upload_part),
                            ("the engine's own Transformer code on CuPy arrays (fp32 weights)", through_cupy),
                            ("GPUTransformer: fp16 weights, hand-written kernels, CUDA graph", engine_gpu)])

    no_gpu = "skipped (no GPU)" if why_no_gpu() else "not measured"
    rows = [["CPU engine (NumPy, fp32): the reference", "host", f"{cpu_ms:.2f}", f"{1e3 / cpu_ms:,.0f}", "0", "-",
             f"{n_new + 1}/{n_new + 1}"]]
    for key, label, where in (("cupy", "the engine's Transformer on CuPy arrays", "GPU, fp32"),
                              ("gpu", "GPUTransformer (kernels + CUDA graph)", "GPU, fp16")):
        if key in results:
            ms, err, rel, agree = results[key]
            rows.append([label, where, f"{ms:.2f}", f"{1e3 / ms:,.0f}", f"{err:.2e}", f"{rel:.1e}",
                         f"{agree}/{n_new + 1}"])
        else:
            rows.append([label, where] + [no_gpu] * 5)
    print_table(f"one decode step, the same {n_new} tokens fed to each path (ms: median; logits compared with the "
                f"CPU after the prompt and after each token)",
                ["path", "weights", "ms/token", "tok/s", "max |Δ logit|", "relative", "same top-1"], rows)
    if "cupy" in results and "gpu" in results:
        print(f"Same model, same GPU: the engine's NumPy code on CuPy takes {results['cupy'][0]:.2f} ms a token, "
              f"GPUTransformer {results['gpu'][0]:.2f} ms. The weights are only 2x smaller; the rest is hundreds of "
              f"small CuPy launches per layer (lesson 13) and unfused elementwise passes (lesson 12).")
    if "gpu" in results:
        print(f"What stayed on the host matters now: top-p sampling took {sampling_us} µs on this CPU, "
              f"GPUTransformer's whole decode step {1e3 * results['gpu'][0]:,.0f} µs (greedy argmax is cheap).")
    if failed:
        sys.exit(f"GPU parts failed: {', '.join(failed)}")


def copy_us(nbytes: int, pinned: bool, reps: int) -> tuple[float, float]:
    """Median µs of one host -> device and one device -> host copy of nbytes (each synchronous)."""
    import cupy as cp
    import cupyx
    host = cupyx.empty_pinned(nbytes, np.uint8) if pinned else np.empty(nbytes, np.uint8)
    host[:] = 1                                          # touch every page before timing
    dev = cp.empty(nbytes, cp.uint8)
    stream = cp.cuda.get_current_stream()
    up, down = [], []
    for _ in range(reps + 1):                            # the first pair warms up and is dropped
        start = time.perf_counter()
        dev.set(host)
        stream.synchronize()
        up.append(time.perf_counter() - start)
        start = time.perf_counter()
        dev.get(out=host)                                # blocks until the copy is done
        down.append(time.perf_counter() - start)
    return 1e6 * statistics.median(up[1:]), 1e6 * statistics.median(down[1:])


if __name__ == "__main__":
    main()
