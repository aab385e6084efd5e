"""`minillm bench`: prefill and decode speed on this machine, against its limits and against a peer.

Decode at batch 1 reads every weight once per token, so its ceiling is memory bandwidth:
    roofline tok/s = bandwidth / bytes read per token.
Prefill of T tokens does 2 × params × T FLOPs in a few large matrix products, so its ceiling is
the machine's matmul FLOP/s. Both ceilings are measured here, with NumPy, in the same run, and the
same workload runs through HF transformers (eager PyTorch) on the same weights for comparison.

The comparison is only fair at equal thread counts (issue 40: minillm on one BLAS thread against
torch's default two, in one process, printed "decode 20x"; one thread each gave 1.9x). So HF runs in
a process of its own (tools/hf_peer.py), both sides run at each count of `thread_counts()`, the
headline ratio is at the first (the same for both), and a second line lets each side use its best.
"""
from __future__ import annotations

import importlib.util
import os
import platform
import statistics
import tempfile
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import numpy as np

from minillm.backend import as_f32
from minillm.errors import MiniLLMError
from minillm.threads import blas_threads, candidates, for_rows, pinned, policy, user_limit
from minillm.model.config import ModelConfig
from minillm.model.kv_cache import int8_kv_bytes_per_token
from minillm.resources import install_hint
from minillm.tools.hf_peer import HFPeer, PeerError


# ---- the machine ---------------------------------------------------------------------------------

def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes per second moved by a large NumPy copy (read + write counted), best of `repeats`."""
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    best = min(_time(lambda: np.copyto(dst, src)) for _ in range(repeats))
    return 2 * nbytes / best


def gemv_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes per second a large fp32 matrix-vector product streams: the practical decode ceiling."""
    cols = 4096
    w = np.ones((nbytes // 4 // cols, cols), dtype=np.float32)
    x = np.ones(cols, dtype=np.float32)
    best = min(_time(lambda: w @ x) for _ in range(repeats))
    return w.nbytes / best


def matmul_flops(n: int = 1536, repeats: int = 3) -> float:
    """FLOP/s of a square fp32 matrix product (on the BLAS threads of the moment)."""
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    best = min(_time(lambda: a @ a) for _ in range(repeats))
    return 2 * n ** 3 / best


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, NumPy {np.__version__}"


# ---- the workload --------------------------------------------------------------------------------

@dataclass
class Result:
    name: str
    threads: int             # the threads it ran on, as its library reports them (BLAS for minillm, torch for HF)
    ttft_s: float            # prefill of the prompt (median)
    decode_tok_s: float      # tokens per second at decode (median step)
    tokens: list[int]        # the greedy tokens: one from the prefill, one per decode step
    all_logits_ttft_s: float | None = None    # HF only: its plain forward, logits for every position (median)


HF_NAME = "HF transformers (eager)"


def decode_bytes_per_token(model, context: int) -> int:
    """Weights read by one decode step (every matrix once; the LM head once even if tied) plus
    the KV cache read by attention at `context` positions (fp32, or int8 codes and a 4-byte scale
    per vector)."""
    cfg = model.config
    total = sum(a.nbytes for a in model.weights_read_per_token())
    per_token = int8_kv_bytes_per_token(cfg) if kv_name(model) == "int8" else cfg.kv_bytes_per_token(4)
    return total + per_token * context


def kv_name(model) -> str:
    return getattr(model, "kv_cache", "auto")


def minillm_name(model) -> str:
    return "minillm (NumPy)" if kv_name(model) == "auto" else f"minillm (NumPy, {kv_name(model)} KV)"


def prefill_flops(cfg: ModelConfig, n_tokens: int) -> float:
    """Matrix FLOPs of a prefill: 2 per weight per token in the layers, causal attention, one LM head row.
    (The usual count, the same for both sides; minillm's last layer runs its attention, o and MLP for the
    last row only, ~3% less than this at SmolLM2's 30 layers.)"""
    per_layer = cfg.dim * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + 3 * cfg.dim * cfg.ffn_dim
    weights = 2 * cfg.n_layers * per_layer * n_tokens
    return weights + attention_flops(cfg, n_tokens) + 2 * cfg.vocab_size * cfg.dim


def attention_flops(cfg: ModelConfig, n_tokens: int) -> float:
    """q·kᵀ and p·v over the causal triangle, every layer and head."""
    return 2 * 2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * n_tokens * (n_tokens + 1) / 2


def bench_minillm(model, prompt: list[int], new_tokens: int, repeats: int) -> Result:
    ttfts, steps = [], []
    for _ in range(repeats):
        cache = model.new_cache(len(prompt) + new_tokens + 1)
        for_rows(len(prompt))                     # each phase on the policy's BLAS threads, as generate does
        threads = blas_threads()
        start = time.perf_counter()
        logits = model.prefill(prompt, cache)
        ttfts.append(time.perf_counter() - start)
        tokens = [int(np.argmax(logits))]
        for_rows(1)
        for _ in range(new_tokens):
            start = time.perf_counter()
            tokens.append(int(np.argmax(model.decode(tokens[-1], cache))))
            steps.append(time.perf_counter() - start)
    return Result(minillm_name(model), threads, statistics.median(ttfts), 1.0 / statistics.median(steps), tokens)


def hf_round(peer: HFPeer, prompt: list[int], new_tokens: int, threads: int, plain_forward: bool = False) -> Result:
    """One round of the same workload in the HF peer process, on `threads` torch threads."""
    reply = peer.measure(prompt, new_tokens, threads, plain_forward)
    return Result(HF_NAME, reply["threads"], reply["ttft_s"], reply["decode_tok_s"], reply["tokens"],
                  reply.get("plain_forward_s"))


@contextmanager
def hf_peer(model):
    """The same weights in HF transformers (fp32, eager), in a process of its own; None when torch or
    transformers are not installed."""
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        yield None
        return
    from minillm.checkpoints.weights import save_hf_dir
    with tempfile.TemporaryDirectory() as tmp:
        save_hf_dir(tmp, model.config.replace(torch_dtype="float32"),
                    {k: as_f32(v) for k, v in model.hf_tensors().items()})
        try:
            with HFPeer(tmp) as peer:
                yield peer
        except PeerError as e:
            raise MiniLLMError(str(e)) from None


def thread_counts() -> list[int]:
    """The counts both sides are measured at: the user's (--threads N, $OMP_NUM_THREADS, ...) alone, else
    threads.candidates() (1, half the cores, all). The first is the headline's."""
    fixed = user_limit()
    return [fixed[0]] if fixed is not None else candidates()


def interleaved(model, peer: HFPeer | None, prompt: list[int], new_tokens: int, repeats: int,
                counts: list[int]) -> list[Result]:
    """minillm and (when given) the HF peer at each thread count, measured in alternating rounds after
    one warm-up round: on a shared machine a burst of someone else's work then slows every row, not
    one. Each result is the median over rounds (TTFT; decode tok/s of each round's median step). The
    headline count's HF rounds also time HF's plain forward."""
    def minillm_at(n):
        with pinned(n):
            return bench_minillm(model, prompt, new_tokens, 1)
    sides = []
    for n in counts:
        sides.append(lambda n=n: minillm_at(n))
        if peer is not None:
            sides.append(lambda n=n: hf_round(peer, prompt, new_tokens, n, plain_forward=n == counts[0]))
    rounds: list[list[Result]] = [[] for _ in sides]
    for i in range(repeats + 1):
        for measure, results in zip(sides, rounds):
            result = measure()
            if i > 0:                                   # round 0 warms caches and thread pools
                results.append(result)
    return [_median(rs) for rs in rounds]


def _median(rounds: list[Result]) -> Result:
    full = [r.all_logits_ttft_s for r in rounds if r.all_logits_ttft_s is not None]
    return Result(rounds[0].name, rounds[-1].threads, statistics.median(r.ttft_s for r in rounds),
                  statistics.median(r.decode_tok_s for r in rounds), rounds[-1].tokens,
                  statistics.median(full) if full else None)


def ratio_lines(results: list[Result]) -> list[str]:
    """The headline (minillm / HF at the first count, the same for both) and each side at its own best count."""
    ours = [r for r in results if r.name != HF_NAME]
    theirs = [r for r in results if r.name == HF_NAME]
    a, b = ours[0], theirs[0]
    same = (f"minillm / HF on the same thread count (minillm {threads_text(a.threads)}, HF {threads_text(b.threads)}): "
            f"decode {a.decode_tok_s / b.decode_tok_s:.2f}×, prefill {b.ttft_s / a.ttft_s:.2f}×")
    a, b = (max(side, key=lambda r: r.decode_tok_s) for side in (ours, theirs))
    own = (f"minillm / HF, each on its own best count: decode {a.decode_tok_s / b.decode_tok_s:.2f}× "
           f"(minillm {threads_text(a.threads)}, HF {threads_text(b.threads)}), ")
    a, b = (min(side, key=lambda r: r.ttft_s) for side in (ours, theirs))
    own += f"prefill {b.ttft_s / a.ttft_s:.2f}× (minillm {threads_text(a.threads)}, HF {threads_text(b.threads)})"
    return [same, own]


def threads_text(n: int) -> str:
    return f"{n} thread{'s' if n != 1 else ''}"


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy runs share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def random_model(cfg: ModelConfig, seed: int = 0):
    """A model of `cfg`'s shape with random weights: speed does not depend on the values."""
    from minillm.model.transformer import Transformer
    rng = np.random.default_rng(seed)
    hd = cfg.head_dim
    shapes = {"input_layernorm": (cfg.dim,), "post_attention_layernorm": (cfg.dim,),
              "self_attn.q_proj": (cfg.n_heads * hd, cfg.dim), "self_attn.k_proj": (cfg.n_kv_heads * hd, cfg.dim),
              "self_attn.v_proj": (cfg.n_kv_heads * hd, cfg.dim), "self_attn.o_proj": (cfg.dim, cfg.n_heads * hd),
              "mlp.gate_proj": (cfg.ffn_dim, cfg.dim), "mlp.up_proj": (cfg.ffn_dim, cfg.dim),
              "mlp.down_proj": (cfg.dim, cfg.ffn_dim)}
    if cfg.qk_norm:                                        # Qwen3, Gemma 3
        shapes |= {"self_attn.q_norm": (hd,), "self_attn.k_norm": (hd,)}
    if cfg.sandwich_norms:                                 # Gemma: the gains are 1 + w, so w = 0 is a gain of 1
        shapes |= {"pre_feedforward_layernorm": (cfg.dim,), "post_feedforward_layernorm": (cfg.dim,)}
    t = {"model.embed_tokens.weight": rng.standard_normal((cfg.vocab_size, cfg.dim), dtype=np.float32) * 0.02,
         "model.norm.weight": np.ones(cfg.dim, np.float32)}
    if not cfg.tie_embeddings:
        t["lm_head.weight"] = rng.standard_normal((cfg.vocab_size, cfg.dim), dtype=np.float32) * 0.02
    for i in range(cfg.n_layers):
        for name, shape in shapes.items():
            scale = 1.0 if len(shape) == 1 else 0.02
            t[f"model.layers.{i}.{name}.weight"] = (rng.standard_normal(shape, dtype=np.float32) * scale
                                                    if len(shape) > 1 else np.ones(shape, np.float32))
    return Transformer(cfg, t)


def quantized(model, method: str, group_size: int = 128):
    """The same model with its layer matrices quantized (minillm.model.quant), as load(quant=...) does."""
    from minillm.model.transformer import Transformer
    from minillm.checkpoints.quantize import quantize_checkpoint
    return Transformer(*quantize_checkpoint(model.config, model.hf_tensors(), method, group_size))


PREFILL_PARTS = {"weight matmuls": ("model/layers.py", "linear"),
                 "attention": ("model/attention.py", "grouped_attention"),
                 "silu": ("model/layers.py", "silu"), "rmsnorm": ("model/layers.py", "rmsnorm"),
                 "rope": ("model/layers.py", "apply_rope")}


def prefill_breakdown(model, prompt: list[int]) -> dict[str, float]:
    """Where one prefill's wall time goes, in seconds, from cProfile's cumulative times: the weight
    matmuls (`layers.linear`), attention (its small per-block matmuls and softmax), SiLU, RMSNorm,
    RoPE, and "other" (residual adds, cache writes, reshapes, the embedding lookup)."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.runcall(model.prefill, prompt, model.new_cache(len(prompt) + 1))
    stats = pstats.Stats(profile).stats             # {(file, line, function): (calls, ..., cumulative s, ...)}

    def cumulative(file: str, function: str) -> float:
        return sum(row[3] for (path, _, name), row in stats.items() if path.endswith(file) and name == function)
    parts = {label: cumulative(*where) for label, where in PREFILL_PARTS.items()}
    parts["other"] = cumulative("model/transformer.py", "prefill") - sum(parts.values())
    return parts


def run(model, prompt_tokens: int = 512, new_tokens: int = 32, repeats: int = 3, peer: bool = True,
        echo=print) -> dict:
    """Measure and print the table; return the numbers (for docs and tests)."""
    cfg = model.config
    if prompt_tokens + new_tokens > cfg.max_seq_len:
        raise MiniLLMError(f"{prompt_tokens} prompt + {new_tokens} new tokens exceed this model's context of "
                           f"{cfg.max_seq_len}: lower --prompt-tokens or --new-tokens")
    prompt = np.random.default_rng(0).integers(100, cfg.vocab_size, prompt_tokens).tolist()
    counts = thread_counts()
    echo(f"machine: {machine_description()}")
    echo(f"threads: {policy() or 'BLAS as NumPy set it up (no policy installed)'} (minillm's, for generate and serve)")
    echo(f"compared at {' and '.join(map(str, counts))} thread(s) a side (minillm's BLAS through threadpoolctl, "
         f"HF's torch.set_num_threads); the headline ratio is at {threads_text(counts[0])} for both")
    load_before = os.getloadavg()[0]
    with pinned(counts[-1]):                   # the ceilings at the most threads either side gets, stated
        copy_bw, gemv_bw, flops = copy_bandwidth(), gemv_bandwidth(), matmul_flops()
    echo(f"measured on {threads_text(counts[-1])}: copy {copy_bw / 1e9:.1f} GB/s · fp32 GEMV {gemv_bw / 1e9:.1f} GB/s"
         f" · fp32 matmul {flops / 1e9:.0f} GFLOP/s")
    with hf_peer(model) if peer else nullcontext() as hf:
        if peer and hf is None:
            echo(f"peer: HF transformers not installed ({install_hint('test')})")
        elif hf is not None:
            echo(f"peer: HF transformers in its own process (pid {hf.pid}; this one is {os.getpid()}), {hf.versions}")
        results = interleaved(model, hf, prompt, new_tokens, repeats, counts)
    bytes_per_token = decode_bytes_per_token(model, prompt_tokens + new_tokens // 2)
    work = prefill_flops(cfg, prompt_tokens)
    echo(f"decode reads {bytes_per_token / 1e6:.1f} MB per token ({kv_name(model)} KV cache); prefill of {prompt_tokens} tokens "
         f"is {work / 1e9:.1f} GFLOP")
    echo(f"{'':26s} {'threads':>7s} {'decode tok/s':>12s} {'GB/s':>7s} {'% GEMV bw':>9s} {'% copy bw':>9s}"
         f" {'TTFT ms':>8s} {'GFLOP/s':>8s} {'% matmul':>8s}")
    for r in results:
        gbs = r.decode_tok_s * bytes_per_token
        gflops = work / r.ttft_s
        echo(f"{r.name:26s} {r.threads:7d} {r.decode_tok_s:12.1f} {gbs / 1e9:7.1f} {100 * gbs / gemv_bw:8.0f}% "
             f"{100 * gbs / copy_bw:8.0f}% {r.ttft_s * 1e3:8.0f} {gflops / 1e9:8.0f} {100 * gflops / flops:7.0f}%")
    ours = results[0]
    numbers = {"minillm": ours, "results": results, "copy_bw": copy_bw, "gemv_bw": gemv_bw, "flops": flops,
               "bytes_per_token": bytes_per_token}
    if hf is not None:
        theirs = results[1]                             # HF at the headline count, measured right after minillm
        numbers["hf"] = theirs
        for line in ratio_lines(results):
            echo(line)
        agree = agreeing_prefix(ours.tokens, theirs.tokens)
        echo(f"greedy tokens on the same weights: minillm's and HF's first {agree} of {len(ours.tokens)} agree")
        full = theirs.all_logits_ttft_s
        numbers["hf_all_logits_ttft_s"] = full
        echo(f"HF's plain forward, logits for all {prompt_tokens} positions: {full * 1e3:.0f} ms "
             f"(minillm prefill {full / ours.ttft_s:.2f}× that, both on {threads_text(ours.threads)})")
        floor = (work - attention_flops(cfg, prompt_tokens)) / flops
        echo(f"floor: the weight matmuls alone take {floor * 1e3:.0f} ms at this machine's measured sgemm peak; "
             f"1.5× HF's prefill ({theirs.ttft_s * 1e3:.0f} ms) would need {theirs.ttft_s / 1.5 * 1e3:.0f} ms "
             f"for everything")
    parts = prefill_breakdown(model, prompt)
    weight_flops = prefill_flops(cfg, prompt_tokens) - attention_flops(cfg, prompt_tokens)
    echo(f"minillm prefill, where the time goes (one profiled run, {sum(parts.values()) * 1e3:.0f} ms): "
         + " · ".join(f"{label} {t * 1e3:.0f} ms" for label, t in parts.items())
         + f" (weight matmuls at {weight_flops / parts['weight matmuls'] / 1e9:.0f} GFLOP/s)")
    echo(f"load average (1 min): {load_before:.2f} at the start, {os.getloadavg()[0]:.2f} at the end "
         f"(this machine's {os.cpu_count()} cores are shared: other work slows both sides)")
    numbers["prefill_parts"] = parts
    return numbers


# ---- `minillm bench`: which model, which device --------------------------------------------------
def run_cli(model_name: str, random_weights: bool = False, dtype: str | None = None, prompt_tokens: int = 512,
            new_tokens: int = 32, repeats: int = 3, peer: bool = True, device: str = "cpu",
            quant: str | None = None, group_size: int = 128, kv_cache: str = "auto", echo=print) -> int:
    """What `minillm bench` does: build the model asked for (a checkpoint, or random weights of a
    preset's shape), run the benchmark on its device, print the table. -> the exit code."""
    from minillm.errors import MiniLLMError
    from minillm.llm import load
    from minillm.model.config import PRESETS
    if random_weights and model_name not in PRESETS:
        raise MiniLLMError(f"--random-weights needs a preset name, got {model_name!r}")
    if device == "cuda":
        return _run_cuda(model_name, random_weights, dtype, prompt_tokens, new_tokens, peer, quant, group_size,
                         kv_cache)
    if random_weights:
        net = random_model(PRESETS[model_name].config)
        if quant:
            try:
                net = quantized(net, quant, group_size)
            except ValueError as e:
                raise MiniLLMError(str(e)) from None
    else:
        net = load(model_name, "cpu", dtype, quant, group_size=group_size).model   # measures the thread policy
    if random_weights:
        from minillm.llm import thread_policy
        from minillm.threads import install
        install(thread_policy(net))
    try:
        net = net.with_options(kv_cache=kv_cache)
    except ValueError as e:
        raise MiniLLMError(str(e)) from None
    run(net, prompt_tokens, new_tokens, repeats, peer, echo=echo)
    return 0


def _run_cuda(model_name, random_weights, dtype, prompt_tokens, new_tokens, peer, quant, group_size, kv_cache) -> int:
    """The GPU benchmark runs on random weights of a preset's shape, made on the device."""
    from minillm.errors import MiniLLMError
    from minillm.llm import check_device
    from minillm.model.config import PRESETS
    if kv_cache == "int8":
        raise MiniLLMError("on cuda, long-context decode with the int8 KV cache is timed by "
                           "python -m minillm.cuda.dev.qbench --kv-cache")
    if not random_weights:
        raise MiniLLMError("--device cuda benchmarks random weights of a preset's shape: "
                           "add --random-weights and --model PRESET (e.g. mistral-7b)")
    if quant == "int4" and group_size % 32:
        raise MiniLLMError(f"int4 groups must be a multiple of 32, got {group_size}")
    if quant not in (None, "int8", "int4"):
        raise MiniLLMError(f"--device cuda benchmarks int8 or int4 layer weights, not {quant}")
    if dtype == "float32":
        raise MiniLLMError("--device cuda benchmarks 16-bit weights: --dtype float16 or bfloat16")
    check_device("cuda")
    from minillm.tools.gpu_bench import run as gpu_bench
    return gpu_bench(model_name, PRESETS[model_name].config, dtype or "float16", quant, group_size, new_tokens, 16,
                     prompt_tokens, peer)
