"""This checkout against a baseline checkout of minillm on one GPU: the same numbers, then the same speed.

    python3 minillm/cuda/dev/ab_commit.py --base .base [--new .] [--rounds 7] [--budget 540] [--serve-runs 2]

For each shape (Mistral-7B, Llama-3.2-1B, SmolLM2-135M) and weight format (fp16, int8, int4), two worker
processes build `GPUTransformer.random(config, "float16", seed=0, quant=...)`, one from each tree (its own
PYTHONPATH and working directory, so each imports its own minillm), and then:

    identity  a 16-token prompt and 32 greedy decode steps: every logit of both trees equal, bit for bit
              (fp16 models also with kv_cache="int8"; Mistral-7B fp16 also a 512-token prefill's logits)
    speed     decode tok/s (256 greedy steps after the prompt, CUDA graph, host argmax each step, as `minillm
              bench --device cuda` times it) in alternating rounds; TTFT of a 512-token prompt for Mistral-7B
              fp16 (the median of 5 prefills a round). The order flips every round: base new, new base, ...
    serve     `minillm bench serve` at 64 users in each tree, alternating, while the time budget lasts: the
              batched server's output tok/s over the sequential one's, per tree

Both trees are timed by the code in this file, so only the model code differs. Only one worker runs at a
time; the other waits with its model in memory. The table comes last; every worker's log is under --out.
--cpu runs the same protocol on a tiny random CPU Transformer of each tree: the script's own check, on a
machine without a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SHAPES = ("mistral-7b", "llama-3.2-1b", "smollm2-135m")
FORMATS = ("float16", "int8", "int4")
PROMPT, STEPS, TTFT_LEN, TTFT_REPEATS = 16, 32, 512, 5
TTFT_MODEL = ("mistral-7b", "float16")     # the one model whose TTFT is timed (and its 512-token logits compared)
MARK = "AB "                       # a worker's answers start with this; anything else it prints is log


# ---- the worker: one tree's model, answering the coordinator on stdin/stdout ------------------------
def build(preset: str, fmt: str, cpu: bool):
    from minillm.model.config import PRESETS
    if cpu:
        return tiny_cpu_model(PRESETS[preset].config.family)
    from minillm.cuda.gpu_model import GPUTransformer
    return GPUTransformer.random(PRESETS[preset].config, "float16", seed=0,
                                 quant=None if fmt == "float16" else fmt)


def tiny_cpu_model(family: str):
    """--cpu: a 2-layer random CPU Transformer, the same in both trees (the script's own check)."""
    from minillm.model.config import ModelConfig
    from minillm.model.transformer import Transformer
    c = ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=2048,
                    family=family)
    rng, hd = np.random.default_rng(0), c.head_dim
    shapes = {"self_attn.q_proj": (c.n_heads * hd, c.dim), "self_attn.k_proj": (c.n_kv_heads * hd, c.dim),
              "self_attn.v_proj": (c.n_kv_heads * hd, c.dim), "self_attn.o_proj": (c.dim, c.n_heads * hd),
              "mlp.gate_proj": (c.ffn_dim, c.dim), "mlp.up_proj": (c.ffn_dim, c.dim),
              "mlp.down_proj": (c.dim, c.ffn_dim)}
    t = {"model.embed_tokens.weight": rng.standard_normal((c.vocab_size, c.dim), dtype=np.float32),
         "lm_head.weight": rng.standard_normal((c.vocab_size, c.dim), dtype=np.float32) * 0.1,
         "model.norm.weight": np.ones(c.dim, np.float32)}
    for i in range(c.n_layers):
        t |= {f"model.layers.{i}.{name}.weight": rng.standard_normal(shape, dtype=np.float32) * 0.1
              for name, shape in shapes.items()}
        t |= {f"model.layers.{i}.{norm}.weight": np.ones(c.dim, np.float32)
              for norm in ("input_layernorm", "post_attention_layernorm")}
    return Transformer(c, t)


def greedy_logits(model, prompt, steps: int) -> np.ndarray:
    """[steps + 1, vocab]: the prompt's last logits, then each greedy decode step's."""
    cache = model.new_cache(len(prompt) + steps + 8)
    out = [model.prefill(prompt, cache)]
    for _ in range(steps):
        out.append(model.decode(int(np.argmax(out[-1])), cache))
    return np.stack(out)


def decode_tok_s(model, cache, prompt, n_new: int) -> float:
    cache.reset()
    logits = model.prefill(prompt, cache)
    start = time.perf_counter()
    for _ in range(n_new):
        logits = model.decode(int(np.argmax(logits)), cache)
    return n_new / (time.perf_counter() - start)


def ttft_ms(model, cache, prompt) -> float:
    times = []
    for _ in range(TTFT_REPEATS):
        cache.reset()
        start = time.perf_counter()
        model.prefill(prompt, cache)                   # host logits: the copy back is in the time
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def answer(**fields) -> None:
    print(MARK + json.dumps(fields), flush=True)


def worker(args) -> int:
    from importlib.util import find_spec
    model = build(args.preset, args.format, args.cpu)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(1)
    prompt, long_prompt = rng.integers(0, vocab, PROMPT), rng.integers(0, vocab, TTFT_LEN)
    saved = Path(args.save)
    saved.mkdir(parents=True, exist_ok=True)
    np.save(saved / "greedy.npy", greedy_logits(model, prompt, STEPS))
    if args.kv_int8:
        np.save(saved / "greedy_kv_int8.npy", greedy_logits(model.with_options(kv_cache="int8"), prompt, STEPS))
    cache = model.new_cache(max(TTFT_LEN, PROMPT + args.new_tokens) + 8)     # as `minillm bench` sizes it
    if args.ttft:
        cache.reset()
        np.save(saved / "prefill_512.npy", model.prefill(long_prompt, cache))
    decode_tok_s(model, cache, prompt, args.new_tokens)     # warm-up: captures the decode graph
    answer(ready=True, minillm=str(Path(find_spec("minillm").origin).resolve().parent.parent),
           weight_bytes=int(getattr(model, "weight_bytes", 0)))
    for line in sys.stdin:
        what = line.strip()
        if what == "decode":
            answer(value=decode_tok_s(model, cache, prompt, args.new_tokens))
        elif what == "ttft":
            answer(value=ttft_ms(model, cache, long_prompt))
        else:
            return 0
    return 0


# ---- the coordinator --------------------------------------------------------------------------------
class Worker:
    """One tree's worker process for one (shape, format); its stderr and stray stdout go to `log`."""

    def __init__(self, tree: Path, label: str, args, preset: str, fmt: str, out: Path):
        self.label, self.tree = label, tree
        self.log = open(out / f"{preset}-{fmt}-{label}.log", "w")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--preset", preset, "--format", fmt,
               "--new-tokens", str(args.new_tokens), "--save", str(args.logits / label / f"{preset}-{fmt}")]
        cmd += ["--kv-int8"] * (fmt == "float16") + ["--ttft"] * ((preset, fmt) == TTFT_MODEL)
        cmd += ["--cpu"] * args.cpu
        env = dict(os.environ, PYTHONPATH=str(tree), PYTHONUNBUFFERED="1")
        # cwd = the tree too: `python -c`/`-m` would put the current directory first on sys.path
        self.proc = subprocess.Popen(cmd, cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True)

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
            self.log.write(line)
        raise RuntimeError(f"the {self.label} worker ended (rc {self.proc.wait()}); see {self.log.name}")

    def ask(self, what: str) -> float:
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        return self.read()["value"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.log.close()


def spread(values: list[float]) -> float:
    """± half the range, as a fraction of the median (serve bench's spread column)."""
    return (max(values) - min(values)) / 2 / statistics.median(values)


def compare_logits(logits: Path, name: str) -> list[list[str]]:
    """One row per run the workers saved: base's and new's logits equal bit for bit, or how they differ."""
    rows = []
    for path in sorted((logits / "base" / name).glob("*.npy")):
        if not (logits / "new" / name / path.name).exists():
            rows.append([name, path.stem, "MISSING", "the new tree's worker saved none"])
            continue
        a, b = np.load(path), np.load(logits / "new" / name / path.name)
        same = a.shape == b.shape and np.array_equal(a, b)
        if same:
            detail = f"{a.shape[0] if a.ndim > 1 else 1} x {a.shape[-1]} logits"
        elif a.shape != b.shape:
            detail = f"shapes {a.shape} vs {b.shape}"
        else:
            rows_differ = np.nonzero((a != b).reshape(len(a) if a.ndim > 1 else 1, -1).any(axis=1))[0]
            detail = f"max |diff| {np.abs(a - b).max():.3g}, first differing row {rows_differ[0]}"
        rows.append([name, path.stem, "equal" if same else "DIFFERENT", detail])
    return rows


def run_pair(args, out: Path, preset: str, fmt: str, identity: list, speed: list) -> None:
    pair = {}
    for label in ("base", "new"):                # no stale logits from an earlier run
        shutil.rmtree(args.logits / label / f"{preset}-{fmt}", ignore_errors=True)
    try:
        pair = {label: Worker(tree, label, args, preset, fmt, out) for label, tree in
                (("base", args.base), ("new", args.new))}
        for w in pair.values():                  # both build and check at once; nothing is timed yet
            info = w.read()
            if Path(info["minillm"]) != w.tree:
                raise RuntimeError(f"the {w.label} worker imported minillm from {info['minillm']}, not {w.tree}")
        name = f"{preset}-{fmt}"
        identity += compare_logits(args.logits, name)
        metrics = [("decode tok/s", "decode")] + [("TTFT 512 ms", "ttft")] * ((preset, fmt) == TTFT_MODEL)
        for metric, what in metrics:
            got = {"base": [], "new": []}
            for r in range(args.rounds):
                for label in (("base", "new") if r % 2 == 0 else ("new", "base")):
                    got[label].append(pair[label].ask(what))
            print(f"  {name} {metric}: base {listed(got['base'])}; new {listed(got['new'])}", flush=True)
            base, new = statistics.median(got["base"]), statistics.median(got["new"])
            speed.append([name, metric, f"{base:.1f} ±{100 * spread(got['base']):.1f}%",
                          f"{new:.1f} ±{100 * spread(got['new']):.1f}%", f"{new / base:.3f}"])
    finally:
        for w in pair.values():
            w.close()


SERVE = ["-m", "minillm", "bench", "serve", "--device", "cuda", "--random-weights", "-m", "mistral-7b",
         "--requests", "64", "--concurrency", "64", "--workload", "random", "--prompt-len", "128",
         "--output-len", "64", "--rounds", "1"]
SERVE_CPU = ["-m", "minillm", "bench", "serve", "--random-weights", "-m", "smollm2-135m", "--requests", "2",
             "--concurrency", "2", "--workload", "random", "--prompt-len", "8", "--output-len", "4", "--rounds", "1"]


def serve_ratio(text: str) -> float | None:
    """The batched server's output tok/s over the sequential one's, from bench serve's table."""
    tok_s = {}
    for line in text.splitlines():
        for mode in ("sequential", "continuous batching"):
            if line.startswith(mode) and mode not in tok_s:
                tok_s[mode] = float(line[22:].split()[1])          # columns after the mode: req/s, out tok/s
    return tok_s["continuous batching"] / tok_s["sequential"] if len(tok_s) == 2 else None


def listed(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def run_serve(args, out: Path, started: float) -> list[list[str]]:
    ratios = {"base": [], "new": []}
    for r in range(args.serve_runs):
        for label, tree in (("base", args.base), ("new", args.new)):
            left = args.budget - (time.monotonic() - started)
            if left < args.serve_limit:
                print(f"serve: {label} run {r + 1} skipped, {left:.0f} s of the budget left", flush=True)
                continue
            cmd = [sys.executable] + (SERVE_CPU if args.cpu else SERVE)
            env = dict(os.environ, PYTHONPATH=str(tree), PYTHONUNBUFFERED="1")
            try:
                done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True,
                                      timeout=args.serve_limit)
                text = done.stdout + done.stderr
            except subprocess.TimeoutExpired as e:
                text = f"timed out after {args.serve_limit} s\n{e.stdout or ''}"
            (out / f"serve-{label}-{r + 1}.log").write_text(text)
            ratio = serve_ratio(text)
            print(f"serve {label} run {r + 1}: {'no table (see its log)' if ratio is None else f'{ratio:.2f}x'}",
                  flush=True)
            if ratio is not None:
                ratios[label].append(ratio)
    if not (ratios["base"] and ratios["new"]):
        return []
    base, new = statistics.median(ratios["base"]), statistics.median(ratios["new"])
    return [["smollm2-135m (cpu)" if args.cpu else "mistral-7b", "serve, x sequential",
             f"{base:.2f} (runs {listed(ratios['base'])})", f"{new:.2f} (runs {listed(ratios['new'])})",
             f"{new / base:.3f}"]]


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    print(f"\n{title}")
    for row in [header, ["-" * w for w in widths]] + rows:
        print("  " + "  ".join(str(x).ljust(w) for x, w in zip(row, widths)))


def coordinate(args) -> int:
    started = time.monotonic()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    args.base, args.new = Path(args.base).resolve(), Path(args.new).resolve()
    args.logits = Path(args.logits).resolve()
    identity, speed = [], []
    for preset in filter(None, args.shapes.split(",")):          # --shapes '': bench serve alone
        for fmt in args.formats.split(","):
            if time.monotonic() - started > args.budget - 30:
                print(f"{preset} {fmt}: skipped, out of time", flush=True)
                continue
            print(f"=== {preset} {fmt}  {time.monotonic() - started:.0f} s", flush=True)
            try:
                run_pair(args, out, preset, fmt, identity, speed)
            except RuntimeError as e:
                print(f"{preset} {fmt}: {e}", flush=True)
                identity.append([f"{preset}-{fmt}", "-", "FAILED", str(e)])
    speed += run_serve(args, out, started)
    table(f"bit identity, {args.new} against {args.base}", ["model", "run", "logits", "detail"], identity)
    table(f"speed: median of {args.rounds} alternating rounds (± half the range); ratio = new / base",
          ["model", "metric", "base", "new", "new/base"], speed)
    failed = [r for r in identity if r[2] != "equal"]
    print(f"\n{'bit identity holds' if identity and not failed else f'{len(failed)} identity row(s) failed'}; "
          f"{time.monotonic() - started:.0f} s")
    return 1 if failed or (args.shapes and not identity) else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="ab_commit.py", description=__doc__.split("\n")[0])
    ap.add_argument("--base", default=".base", help="the baseline checkout (say, `git archive` of the commit before)")
    ap.add_argument("--new", default=".", help="the checkout to measure")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/ab_commit"), help="the workers' logs")
    ap.add_argument("--logits", default="/tmp/ab_commit_logits", help="the saved logits (tens of MB: not in --out)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated presets ('': serve alone)")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--serve-runs", type=int, default=2, help="bench serve runs per tree (0: none)")
    ap.add_argument("--serve-limit", type=int, default=150, help="seconds one bench serve run may take")
    ap.add_argument("--budget", type=int, default=540, help="seconds: no new step starts past this")
    ap.add_argument("--cpu", action="store_true", help="a tiny CPU model of each tree: the script's own check")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--preset", help=argparse.SUPPRESS)
    ap.add_argument("--format", help=argparse.SUPPRESS)
    ap.add_argument("--save", help=argparse.SUPPRESS)
    ap.add_argument("--kv-int8", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ttft", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    return worker(args) if args.worker else coordinate(args)


if __name__ == "__main__":
    if Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]            # a worker imports minillm from its tree's PYTHONPATH only
    sys.exit(main())
