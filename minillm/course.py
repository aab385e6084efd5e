"""The course: finding and running the lessons, what they share, and the exercise grader.

Lessons live in `lessons/NN_name.py` and exercises in `lessons/exercises/exNN_name.py` of a source
checkout. Every exercise's reference solution is the engine's own code (`minillm.layers.rmsnorm`,
`minillm.kv_cache.KVCache.append`, ...), so a student who passes has written what the engine runs.

Environment variables the lessons honour:
    MINILLM_LESSON_MODEL   a preset, a weights folder or a .gguf (default smollm2-135m, pulled on
                           first use), or `random:PRESET` for random weights of that preset's shape
    MINILLM_LESSON_QUICK   1: tiny sizes, so a lesson runs in seconds (the smoke tests use it)
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Callable, Sequence

import numpy as np

from .errors import MiniLLMError

LESSONS_DIR = Path(__file__).resolve().parent.parent / "lessons"
EXERCISES_DIR = LESSONS_DIR / "exercises"
OUT_DIR = LESSONS_DIR / "out"
MODEL_ENV, QUICK_ENV = "MINILLM_LESSON_MODEL", "MINILLM_LESSON_QUICK"
DEFAULT_LESSON_MODEL = "smollm2-135m"


# ---- finding and running lessons --------------------------------------------------------------------

@dataclass(frozen=True)
class Lesson:
    number: int
    name: str          # "forward_pass"
    path: Path
    title: str         # the first line of the lesson's docstring


def list_lessons() -> list[Lesson]:
    """Every `lessons/NN_name.py`, in order."""
    lessons = []
    for path in sorted(LESSONS_DIR.glob("[0-9][0-9]_*.py")):
        number, name = path.stem.split("_", 1)
        lessons.append(Lesson(int(number), name, path, _first_doc_line(path)))
    return lessons


def find_lesson(number: int) -> Lesson:
    for lesson in list_lessons():
        if lesson.number == number:
            return lesson
    known = ", ".join(f"{l.number:02d} {l.name}" for l in list_lessons()) or "none found"
    raise MiniLLMError(f"no lesson {number:02d} in {LESSONS_DIR} (lessons: {known})")


def run_lesson(number: int, quick: bool = False, model: str | None = None) -> int:
    """Run lesson `number` as its own process (as `python lessons/NN_name.py` would); its exit code."""
    lesson = find_lesson(number)
    env = dict(os.environ)
    if quick:
        env[QUICK_ENV] = "1"
    if model is not None:
        env[MODEL_ENV] = model
    # The checkout's minillm first, so an uninstalled checkout runs its own engine.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(LESSONS_DIR.parent), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, str(lesson.path)], env=env).returncode


def _first_doc_line(path: Path) -> str:
    for line in path.read_text().splitlines():
        line = line.strip().strip('"').strip()
        if line:
            return line
    return ""


# ---- what every lesson shares ---------------------------------------------------------------------

def quick() -> bool:
    """True when the lesson should use tiny sizes (a smoke run, not a measurement)."""
    return os.environ.get(QUICK_ENV, "") not in ("", "0")


def default_lesson_model() -> str:
    """The real SmolLM2 weights if they are already on disk, else random weights of the same shape."""
    from .pull import resolve
    try:
        resolve(DEFAULT_LESSON_MODEL)
        return DEFAULT_LESSON_MODEL
    except MiniLLMError:
        return f"random:{DEFAULT_LESSON_MODEL}"


def lesson_model():
    """The model a lesson runs on ($MINILLM_LESSON_MODEL, default smollm2-135m); prints which it is."""
    import minillm
    from .bench import random_model
    from .config import PRESETS
    from .llm import LLM

    spec = os.environ.get(MODEL_ENV) or DEFAULT_LESSON_MODEL
    if spec.startswith("random:"):
        preset = spec.split(":", 1)[1]
        if preset not in PRESETS:
            raise SystemExit(f"{MODEL_ENV}={spec}: unknown preset {preset!r} ({', '.join(PRESETS)})")
        cfg = PRESETS[preset].config
        print(f"model: random weights in the shape of {preset} (speeds are honest; texts are gibberish)")
        return LLM(cfg, random_model(cfg), StandInTokenizer(cfg.vocab_size), name=spec, chat_default=False)
    try:
        llm = minillm.load(spec)
    except MiniLLMError as e:
        raise SystemExit(f"cannot load {spec}: {e}\n(or run on random weights: "
                         f"{MODEL_ENV}=random:{DEFAULT_LESSON_MODEL})") from None
    print(f"model: {spec} ({llm.config.n_layers} layers, dim {llm.config.dim}, "
          f"{llm.config.n_params / 1e6:.0f}M parameters)")
    return llm


class StandInTokenizer:
    """Stands in for a real tokenizer next to random weights: one id per byte, ids shown as <id>."""
    add_bos, bos_id, eos_ids, chat_template = False, None, [], None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        return [(256 + b) % self.vocab_size for b in text.encode()]

    def decode(self, ids) -> str:
        return "".join(f"<{int(i)}>" for i in ids)

    def stream_decoder(self):
        tok = self

        class _Stream:
            def push(self, token_id: int) -> str:
                return tok.decode([token_id])

            def flush(self) -> str:
                return ""
        return _Stream()


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence]) -> None:
    """Print rows under headers, columns aligned (numbers right, text left)."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [all(_looks_numeric(r[i]) for r in cells) for i in range(len(headers))]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric))
    print(f"\n{title}")
    print(line(headers))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print(line(r))


def _looks_numeric(s: str) -> bool:
    return bool(s) and (s[0].isdigit() or s[0] in "-+.") and not s.startswith("--")


def save_plot(filename: str, draw: Callable) -> Path | None:
    """Draw a figure with `draw(ax)` and write it to lessons/out/; skip with a note without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"plot {filename} skipped: matplotlib is not installed (pip install 'minillm[lessons]')")
        return None
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    draw(ax)
    fig.tight_layout()
    path = OUT_DIR / filename
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")
    return path


def hf_tensors(model) -> dict[str, np.ndarray]:
    """The HF-named weights of a loaded GQA `Transformer`, to convert them or rebuild it with another config."""
    return model.hf_tensors()


def best_time(fn: Callable, repeats: int = 3) -> float:
    """The fastest of `repeats` runs of fn(), in seconds: the least disturbed by other work."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


# ---- lessons with GPU parts (11-13) ----------------------------------------------------------------

def why_no_gpu() -> str | None:
    """None when CuPy can use a CUDA device; else one line saying why a lesson's GPU parts are skipped."""
    try:
        import cupy
    except Exception as e:  # noqa: BLE001 - any import failure means the same thing here
        return f"CuPy is not importable ({type(e).__name__}); pip install 'minillm[gpu]' on a GPU machine"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no driver, no device: the message says which
        return f"CuPy {cupy.__version__} finds no usable CUDA device ({str(e).splitlines()[0]})"
    return None if n > 0 else f"CuPy {cupy.__version__} sees no CUDA device"


def gpu_description() -> str:
    """One line naming the GPU, for the top of a lesson's GPU measurements."""
    import cupy as cp
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return (f"{name} (sm_{props['major']}{props['minor']}, {props['multiProcessorCount']} SMs, "
            f"{props['totalGlobalMem'] / 2**30:.0f} GiB), CuPy {cp.__version__}")


def run_gpu_parts(parts: Sequence[tuple[str, Callable[[], None]]]) -> list[str]:
    """Run a lesson's GPU parts in order, each under a numbered heading, or list them as skipped.

    A part that raises prints its traceback and the next part still runs, so one run on a GPU machine
    shows every failure next to the part it belongs to.   -> the names of the parts that failed"""
    import traceback
    why = why_no_gpu()
    if why is not None:
        print(f"\nGPU parts skipped: {why}. On a machine with a GPU this lesson also measures:")
        for i, (name, _) in enumerate(parts, 1):
            print(f"  [GPU {i}/{len(parts)}] {name}: skipped (no GPU)")
        return []
    print(f"\nGPU: {gpu_description()}")
    failed = []
    for i, (name, part) in enumerate(parts, 1):
        print(f"\n[GPU {i}/{len(parts)}] {name}", flush=True)
        try:
            part()
        except Exception:  # noqa: BLE001 - report it under its heading and go on
            traceback.print_exc(file=sys.stdout)
            print(f"[GPU {i}/{len(parts)}] {name}: FAILED (traceback above)", flush=True)
            failed.append(name)
    return failed


# ---- exercises: the grader ------------------------------------------------------------------------

@dataclass
class CaseResult:
    name: str
    passed: bool
    detail: str


@dataclass
class Report:
    number: int
    function: str
    source: str
    cases: list[CaseResult] = field(default_factory=list)
    note: str = ""       # a message for the whole exercise (not written yet, not found, ...)

    @property
    def passed(self) -> bool:
        return bool(self.cases) and all(c.passed for c in self.cases) and not self.note

    @property
    def failures(self) -> list[CaseResult]:
        return [c for c in self.cases if not c.passed]

    def __str__(self) -> str:
        lines = [f"exercise {self.number:02d}: {self.function} ({self.source})"]
        lines += [f"  {'PASS' if c.passed else 'FAIL'}  {c.name}: {c.detail}" for c in self.cases]
        if self.note:
            lines.append(f"  {self.note}")
        n_ok = sum(c.passed for c in self.cases)
        verdict = "passed" if self.passed else "FAILED"
        lines.append(f"{verdict}: {n_ok}/{len(self.cases)} cases")
        return "\n".join(lines)


class CaseFailed(Exception):
    """Raised by a case's checker with a one-line description of what is wrong."""


def check_exercise(number: int, module: ModuleType | Callable | str | Path | None = None) -> Report:
    """Grade exercise `number`: the student's file by default, or a given module, file or function."""
    exercise = EXERCISES.get(number)
    if exercise is None:
        raise MiniLLMError(f"no exercise {number:02d} (exercises: {', '.join(f'{n:02d}' for n in EXERCISES)})")
    fn, source = _student_function(exercise, module)
    report = Report(number, exercise.function, source)
    if fn is None:
        report.note = f"{source} has no function {exercise.function}()"
        return report
    for case in exercise.cases():
        try:
            detail = exercise.check(fn, case)
            report.cases.append(CaseResult(case.name, True, detail))
        except NotImplementedError:
            report.cases.append(CaseResult(case.name, False, "raised NotImplementedError"))
            report.note = (f"{exercise.function}() is not written yet: open {source}, read the docstring, "
                           f"and replace `raise NotImplementedError` with your code")
            break
        except CaseFailed as e:
            report.cases.append(CaseResult(case.name, False, str(e)))
        except Exception as e:  # a student's bug is a failed case, not a crash of the grader
            report.cases.append(CaseResult(case.name, False, f"raised {type(e).__name__}: {e}"))
    return report


def exercise_path(number: int) -> Path:
    matches = sorted(EXERCISES_DIR.glob(f"ex{number:02d}_*.py"))
    if not matches:
        raise MiniLLMError(f"no file lessons/exercises/ex{number:02d}_*.py in {EXERCISES_DIR}")
    return matches[0]


def load_exercise(number: int, path: str | Path | None = None) -> ModuleType:
    """Import a student's exercise file as a fresh module (edits are picked up every time)."""
    path = Path(path) if path is not None else exercise_path(number)
    spec = importlib.util.spec_from_file_location(f"minillm_exercise_{number:02d}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _student_function(exercise, module) -> tuple[Callable | None, str]:
    if module is None or isinstance(module, (str, Path)):
        path = Path(module) if module is not None else exercise_path(exercise.number)
        module = load_exercise(exercise.number, path)
        source = _display(path)
    elif isinstance(module, ModuleType):
        source = _display(Path(module.__file__)) if getattr(module, "__file__", None) else module.__name__
    else:
        return module, getattr(module, "__qualname__", repr(module))   # a function given directly
    return getattr(module, exercise.function, None), source


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(LESSONS_DIR.parent))
    except ValueError:
        return str(path)


# ---- comparing arrays, with a description a student can act on ------------------------------------

def expect_close(name: str, got, want: np.ndarray, rtol: float = 1e-4, atol: float = 1e-5) -> str:
    """Raise CaseFailed unless `got` has want's shape and values; else return a one-line summary."""
    if not isinstance(got, np.ndarray):
        raise CaseFailed(f"{name} is a {type(got).__name__}, expected a numpy array of shape {list(want.shape)}")
    if got.shape != want.shape:
        raise CaseFailed(f"{name} has shape {list(got.shape)}, expected {list(want.shape)}")
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    scale = max(1.0, float(np.abs(want).max()))
    worst = np.unravel_index(int(np.nanargmax(np.where(np.isnan(err), np.inf, err))), err.shape)
    max_err = float(err[worst]) if not np.isnan(err[worst]) else float("nan")
    if not np.all(np.isfinite(got)) and np.all(np.isfinite(want)):
        raise CaseFailed(f"{name} has NaN/inf values (first at index {list(np.argwhere(~np.isfinite(got))[0])})")
    if not np.allclose(got, want, rtol=rtol, atol=atol * scale):
        raise CaseFailed(f"{name}: max abs error {max_err:.3g} at index {list(map(int, worst))} "
                         f"(got {float(got[worst]):.6g}, expected {float(want[worst]):.6g}; "
                         f"tolerance {atol * scale:.1g} + {rtol:g}·|expected|)")
    return f"{name} {list(got.shape)} max abs error {max_err:.1e}"


def expect_unchanged(name: str, before: np.ndarray, after: np.ndarray) -> None:
    if not np.array_equal(before, after):
        raise CaseFailed(f"modified its input {name} in place; compute a new array instead")


# ---- exercises: the cases, and the engine's reference for each ------------------------------------

@dataclass(frozen=True)
class Case:
    name: str
    inputs: dict


@dataclass(frozen=True)
class Exercise:
    number: int
    function: str                          # the function the student writes
    lesson: int
    reference: Callable                    # the engine's solution, same signature as the student's
    cases: Callable[[], list[Case]]
    check: Callable[[Callable, Case], str]  # run one case; raise CaseFailed or return a summary


# 01: RMSNorm ------------------------------------------------------------------------------------

def _rmsnorm_cases() -> list[Case]:
    rng = np.random.default_rng(1)

    def case(name, T, dim, scale=1.0, eps=1e-5):
        x = ((rng.standard_normal((T, dim)) + 0.5) * scale).astype(np.float32)   # mean ≠ 0: not LayerNorm
        weight = (1.0 + 0.3 * rng.standard_normal(dim)).astype(np.float32)
        return Case(name, dict(x=x, weight=weight, eps=eps))
    return [case("4 positions, dim 64", 4, 64),
            case("one position (a decode step), dim 576 like SmolLM2", 1, 576),
            case("tiny activations (|x| ~ 1e-4), where eps matters", 3, 32, scale=1e-4),
            case("large activations (|x| ~ 1e3)", 3, 32, scale=1e3),
            case("eps 1e-2 on small activations: eps goes inside the square root", 2, 16, scale=0.05, eps=1e-2)]


def _check_rmsnorm(fn, case: Case) -> str:
    from .layers import rmsnorm
    x, weight, eps = case.inputs["x"], case.inputs["weight"], case.inputs["eps"]
    x_in, w_in = x.copy(), weight.copy()
    got = fn(x_in, w_in, eps)
    expect_unchanged("x", x, x_in)
    expect_unchanged("weight", weight, w_in)
    return expect_close("output", got, rmsnorm(x, weight, eps))


# 02: writing into the KV cache ------------------------------------------------------------------

def kv_cache_update_reference(cache_k, cache_v, k_new, v_new, pos):
    """The engine's KVCache.append, for one layer's arrays given by the caller (the exercise's contract)."""
    from .config import ModelConfig
    from .kv_cache import KVCache
    n_kv, max_seq, hd = cache_k.shape
    shape = ModelConfig(vocab_size=1, dim=n_kv * hd, n_layers=1, n_heads=n_kv, n_kv_heads=n_kv,
                        ffn_dim=1, head_dim=hd)
    cache = KVCache(shape, 0, dtype=cache_k.dtype)
    cache.k, cache.v = cache_k[None], cache_v[None]        # views: the engine writes into the caller's arrays
    cache.max_seq_len, cache.length = max_seq, pos
    return cache.append(0, k_new, v_new)


def _kv_cases() -> list[Case]:
    def case(name, n_kv, max_seq, hd, T, pos):
        return Case(name, dict(n_kv=n_kv, max_seq=max_seq, hd=hd, T=T, pos=pos))
    return [case("prefill: 5 positions into an empty cache (pos 0)", 3, 16, 8, 5, 0),
            case("decode: one position at pos 7", 3, 16, 8, 1, 7),
            case("a chunk of 4 positions after 9 cached ones", 2, 16, 4, 4, 9),
            case("the last free slot (pos 15 of 16)", 3, 16, 8, 1, 15),
            case("overflow: 3 positions at pos 14 of 16 must raise ValueError", 3, 16, 8, 3, 14)]


def _check_kv(fn, case: Case) -> str:
    c = case.inputs
    rng = np.random.default_rng(c["pos"] * 31 + c["T"])
    n_kv, max_seq, hd, T, pos = c["n_kv"], c["max_seq"], c["hd"], c["T"], c["pos"]
    # Stale values everywhere (never zeros), so a write to the wrong place cannot hide.
    cache_k, cache_v = (rng.standard_normal((n_kv, max_seq, hd)).astype(np.float32) for _ in range(2))
    k_new, v_new = (rng.standard_normal((n_kv, T, hd)).astype(np.float32) + 3.0 for _ in range(2))
    got_k, got_v = cache_k.copy(), cache_v.copy()
    if pos + T > max_seq:
        try:
            fn(got_k, got_v, k_new.copy(), v_new.copy(), pos)
        except ValueError:
            return "raised ValueError"
        raise CaseFailed(f"pos + T = {pos + T} > capacity {max_seq}, but no ValueError was raised")
    want_k, want_v = cache_k.copy(), cache_v.copy()
    ref = kv_cache_update_reference(want_k, want_v, k_new, v_new, pos)
    out = fn(got_k, got_v, k_new.copy(), v_new.copy(), pos)
    for name, got, want in (("cache_k", got_k, want_k), ("cache_v", got_v, want_v)):
        _expect_cache_written(name, got, want, pos, T)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise CaseFailed(f"returned {type(out).__name__}, expected a tuple (keys, values)")
    summary = expect_close("returned keys", out[0], ref[0], rtol=0, atol=0)
    expect_close("returned values", out[1], ref[1], rtol=0, atol=0)
    if not (np.shares_memory(out[0], got_k) and np.shares_memory(out[1], got_v)):
        raise CaseFailed("returned copies, not views of the cache: every decode step would copy the "
                         "whole cache (return cache_k[:, :pos + T] and cache_v[:, :pos + T])")
    return summary


def _expect_cache_written(name: str, got: np.ndarray, want: np.ndarray, pos: int, T: int) -> None:
    wrong = np.flatnonzero(np.any(got != want, axis=(0, 2)))       # positions that differ
    if wrong.size == 0:
        return
    inside = [int(p) for p in wrong if pos <= p < pos + T]
    outside = [int(p) for p in wrong if not pos <= p < pos + T]
    if outside:
        raise CaseFailed(f"{name} changed at position(s) {outside}, outside the new positions "
                         f"[{pos}, {pos + T}): write k_new to slots pos .. pos+T-1 only")
    raise CaseFailed(f"{name} does not hold the new values at position(s) {inside}: write them into the "
                     f"caller's array in place (not into a copy)")


# 03: RoPE ------------------------------------------------------------------------------------------

def _rope_cases() -> list[Case]:
    def case(name, T, heads, hd, theta, start):
        return Case(name, dict(T=T, heads=heads, hd=hd, theta=theta, start=start))
    return [case("prefill: positions 0..5, 4 heads, head_dim 16", 6, 4, 16, 1e4, 0),
            case("decode: one position at 37, 9 heads, head_dim 64", 1, 9, 64, 1e5, 37),
            case("keys like SmolLM2: 3 KV heads, head_dim 64, positions 100..107", 8, 3, 64, 1e5, 100),
            case("long context: positions 8000..8002", 3, 2, 32, 1e4, 8000),
            case("smallest head: head_dim 2", 4, 1, 2, 1e4, 3)]


def _check_rope(fn, case: Case) -> str:
    from .layers import apply_rope, rope_inv_freq, rope_tables
    c = case.inputs
    rng = np.random.default_rng(c["start"] + c["hd"])
    x = rng.standard_normal((c["T"], c["heads"], c["hd"])).astype(np.float32)
    cos, sin = rope_tables(np.arange(c["start"], c["start"] + c["T"]), rope_inv_freq(c["hd"], c["theta"]))
    x_in, cos_in, sin_in = x.copy(), cos.copy(), sin.copy()
    got = fn(x_in, cos_in, sin_in)
    expect_unchanged("x", x, x_in)
    return expect_close("output", got, apply_rope(x, cos, sin))


# 04: top-p ------------------------------------------------------------------------------------------

def _top_p_cases() -> list[Case]:
    rng = np.random.default_rng(4)
    return [Case("vocab 50, p 0.9", dict(logits=rng.normal(0, 2, 50), p=0.9)),
            Case("p 1.0 keeps every token", dict(logits=rng.normal(0, 2, 100), p=1.0)),
            Case("the token that crosses p is kept: probs 0.2/0.5/0.3, p 0.6",
                 dict(logits=np.log([0.2, 0.5, 0.3]), p=0.6)),
            Case("p 0.01 keeps only the most likely token", dict(logits=rng.normal(0, 2, 50), p=0.01)),
            Case("one token holds 99% of the mass, p 0.95",
                 dict(logits=np.concatenate([[10.0], rng.normal(0, 0.1, 20)]), p=0.95)),
            Case("negative logits, p 0.5", dict(logits=rng.normal(-20, 1, 30), p=0.5)),
            Case("float32 logits, vocab 49152 like SmolLM2, p 0.8",
                 dict(logits=rng.normal(0, 3, 49152).astype(np.float32), p=0.8))]


def _check_top_p(fn, case: Case) -> str:
    from .sampling import softmax, top_p_filter
    logits, p = case.inputs["logits"], case.inputs["p"]
    logits_in = logits.copy()
    got = fn(logits_in, p)
    expect_unchanged("logits", logits, logits_in)
    want = top_p_filter(logits, p)
    if not isinstance(got, np.ndarray) or got.shape != want.shape:
        raise CaseFailed(f"returned {getattr(got, 'shape', type(got).__name__)}, expected an array "
                         f"of shape {list(want.shape)}")
    if np.isnan(got).any():
        raise CaseFailed("returned NaN; dropped tokens should be -inf")
    kept, want_kept = got != -np.inf, want != -np.inf
    if not np.array_equal(kept, want_kept):
        order = np.argsort(-logits, kind="stable")
        probs = softmax(logits[order].astype(np.float64))
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        mass_above = np.cumsum(probs) - probs
        bad = order[(kept != want_kept)[order]][0]                      # the best-ranked wrong token
        r = int(rank[bad])
        what = (f"token {int(bad)} (rank {r + 1}, prob {probs[r]:.3f}, mass of the tokens above it "
                f"{mass_above[r]:.3f})")
        if want_kept[bad]:
            cross = " — it is the token that carries the mass past p" if mass_above[r] + probs[r] >= p else ""
            raise CaseFailed(f"kept {int(kept.sum())} tokens, expected {int(want_kept.sum())}: dropped {what} "
                             f"< p {p}, which must be kept{cross}")
        raise CaseFailed(f"kept {int(kept.sum())} tokens, expected {int(want_kept.sum())}: kept {what} "
                         f">= p {p}, which must be dropped")
    if not np.allclose(got[kept], logits[kept], rtol=1e-6):
        raise CaseFailed("changed the logits it kept: return them as they were, with the dropped ones at -inf")
    return f"kept {int(kept.sum())} of {len(logits)} tokens"


# 05: mean-pooling KV heads ---------------------------------------------------------------------------

def _pool_cases() -> list[Case]:
    def case(name, n_kv, n_new, hd, dim):
        return Case(name, dict(n_kv=n_kv, n_new=n_new, hd=hd, dim=dim))
    return [case("SmolLM2 keys: 3 KV heads -> 1 (MQA), head_dim 64, dim 576", 3, 1, 64, 576),
            case("MHA -> GQA: 8 heads -> 2, groups of 4 consecutive heads", 8, 2, 16, 48),
            case("6 heads -> 3: heads (0, 1), (2, 3), (4, 5)", 6, 3, 8, 32),
            case("n_new = n_kv_heads: nothing to pool, the same weights", 4, 4, 8, 16),
            case("MHA -> MQA: 32 heads -> 1", 32, 1, 8, 16)]


def _check_pool(fn, case: Case) -> str:
    from .kv_heads import pool_heads
    c = case.inputs
    n_kv, n_new, hd, dim = c["n_kv"], c["n_new"], c["hd"], c["dim"]
    rng = np.random.default_rng(n_kv * 100 + n_new)
    # Each head gets its own offset, so mixing up which heads are averaged cannot hide.
    offsets = np.repeat(np.arange(n_kv, dtype=np.float32) * 0.5, hd)[:, None]        # [n_kv * hd, 1]
    w = (rng.standard_normal((n_kv * hd, dim)) * 0.1 + offsets).astype(np.float32)  # [n_kv * hd, dim]
    w_in = w.copy()
    got = fn(w_in, n_kv, n_new, hd)
    expect_unchanged("w", w, w_in)
    want = pool_heads(w, n_kv, n_new, hd)
    group = n_kv // n_new
    if isinstance(got, np.ndarray) and got.shape == want.shape:
        strided = w.reshape(group, n_new, hd, dim).mean(axis=0).reshape(n_new * hd, dim)
        if group > 1 and n_new > 1 and np.allclose(got, strided, atol=1e-5):
            raise CaseFailed(f"new head j is the mean of heads j, j + {n_new}, j + {2 * n_new}, ... (a stride of {n_new}); "
                             f"the groups are consecutive heads j*{group} .. j*{group} + {group - 1}")
        if group > 1 and np.allclose(got, want * group, atol=1e-4):
            raise CaseFailed(f"summed the {group} heads of each group instead of averaging them")
    return expect_close("pooled weights", got, want)


# 06: MLA attention in latent space ------------------------------------------------------------------

def _mla_cases() -> list[Case]:
    def case(name, H, T, L, nope, rope, r, v):
        return Case(name, dict(H=H, T=T, L=L, nope=nope, rope=rope, r=r, v=v))
    return [case("decode: one query against 12 cached latents", 4, 1, 12, 16, 8, 24, 12),
            case("prefill: 6 queries into an empty cache (causal mask)", 4, 6, 6, 16, 8, 24, 12),
            case("a chunk: 3 queries after 7 cached positions", 2, 3, 10, 16, 8, 24, 12),
            case("DeepSeek-V3 head shapes: nope 128, rope 64, r 512, v_head 128", 2, 2, 9, 128, 64, 512, 128),
            case("square W_UK (nope = r = 16): a transposed W_UK gives wrong numbers, not a shape error",
                 3, 2, 5, 16, 8, 16, 16),
            case("a model from mla_convert: nope = 0, scores from the RoPE part alone", 3, 2, 7, 0, 16, 20, 8)]


def _latent_attention(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, scale, causal=True, rope_term=True):
    """The absorbed formula written plainly, with switches the grader uses to name a student's mistake."""
    from .attention import mask_bias
    H, T, _ = q_rope.shape
    scores = (q_nope @ w_uk) @ c_kv.T                                    # [H, T, L]
    if rope_term:
        scores = scores + q_rope @ k_rope.T
    scores = scores * scale
    if causal and T > 1:
        scores = scores + mask_bias(T, c_kv.shape[0])
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return (p @ c_kv) @ w_uv.transpose(0, 2, 1)                          # [H, T, v_head]


def _check_mla(fn, case: Case) -> str:
    from .mla import absorbed_attention
    c = case.inputs
    H, T, L, nope, rope, r, v = (c[k] for k in ("H", "T", "L", "nope", "rope", "r", "v"))
    rng = np.random.default_rng(H * 1000 + T * 100 + L)

    def rand(*shape, s=1.0):
        return (rng.standard_normal(shape) * s).astype(np.float32)
    inputs = dict(q_nope=rand(H, T, nope), q_rope=rand(H, T, rope), c_kv=rand(L, r), k_rope=rand(L, rope),
                  w_uk=rand(H, nope, r, s=r ** -0.5), w_uv=rand(H, v, r, s=r ** -0.5))
    scale = float((nope + rope) ** -0.5)
    copies = {k: a.copy() for k, a in inputs.items()}
    got = fn(**copies, scale=scale)
    for k, a in inputs.items():
        expect_unchanged(k, a, copies[k])
    want = absorbed_attention(**{k: a.copy() for k, a in inputs.items()}, scale=scale)
    if isinstance(got, np.ndarray) and got.shape == want.shape and not np.allclose(got, want, rtol=1e-4, atol=1e-5):
        hints = [(dict(causal=False), "no causal mask: with T > 1, query t (position L - T + t) must not see "
                                      "the positions after it"),
                 (dict(scale=1.0), f"the softmax scale is missing: multiply the scores by scale ({scale:.3g})"),
                 (dict(rope_term=False), "the RoPE part of the score is missing: add q_rope · k_ropeᵀ")]
        for change, message in hints:
            args = dict(inputs, scale=scale) | change
            if np.allclose(got, _latent_attention(**args), rtol=1e-4, atol=1e-5):
                raise CaseFailed(message)
    return expect_close("output", got, want)


# 07: the sliding-window mask -------------------------------------------------------------------------

def _mask_cases() -> list[Case]:
    def case(name, T, L, window):
        return Case(name, dict(T=T, L=L, window=window))
    return [case("prefill: 8 positions, window 3", 8, 8, 3),
            case("decode: the newest of 10 positions, window 4", 1, 10, 4),
            case("a chunk: 3 queries after 9 cached positions, window 5", 3, 12, 5),
            case("window 1: each query sees only itself", 5, 5, 1),
            case("window longer than the sequence: plain causal", 6, 6, 100),
            case("no window (None): plain causal, 4 queries after 3 cached", 4, 7, None),
            case("Mistral at decode: position 5000, window 4096", 1, 5001, 4096)]


def _check_mask(fn, case: Case) -> str:
    from .attention import attention_mask
    T, L, window = case.inputs["T"], case.inputs["L"], case.inputs["window"]
    got = fn(T, L, window)
    want = attention_mask(T, L, window)
    if not isinstance(got, np.ndarray) or got.shape != want.shape:
        raise CaseFailed(f"returned {getattr(got, 'shape', type(got).__name__)}, expected a bool array of "
                         f"shape {list(want.shape)}")
    if got.dtype != bool and not np.isin(got, (0, 1)).all():
        raise CaseFailed(f"returned {got.dtype} values other than 0/1; return a bool array (True = may attend)")
    got = got.astype(bool)
    if np.array_equal(got, want):
        return f"mask {list(want.shape)}: {int(want.sum())} allowed pairs"
    if window is not None and np.array_equal(got, attention_mask(T, L, window + 1)):
        raise CaseFailed(f"each query sees {window + 1} keys, one too many: the window is W = {window} key(s) "
                         f"with the query itself included (positions p - W + 1 .. p)")
    if T < L and np.array_equal(got, _top_left(T, L, window)):
        raise CaseFailed("the queries are the LAST n_queries of the n_keys positions (query i is at position "
                         "n_keys - n_queries + i), not the first")
    i = int(np.flatnonzero((got != want).any(axis=1))[0])
    pos = L - T + i
    return _fail_row(i, pos, got[i], want[i])


def _top_left(T: int, L: int, window) -> np.ndarray:
    """The common mistake: queries placed at positions 0 .. T-1 instead of L-T .. L-1."""
    from .attention import attention_mask
    return attention_mask(T, T, window) if T == L else np.pad(attention_mask(T, T, window), ((0, 0), (0, L - T)))


def _fail_row(i: int, pos: int, got: np.ndarray, want: np.ndarray):
    def spans(row):
        keys = np.flatnonzero(row)
        return "none" if keys.size == 0 else (f"{keys[0]}..{keys[-1]}" if keys[-1] - keys[0] + 1 == keys.size
                                               else ", ".join(map(str, keys[:8])) + (" ..." if keys.size > 8 else ""))
    raise CaseFailed(f"query {i} (position {pos}) may see keys {spans(want)}; yours allows {spans(got)}")


# 08-10: quantization: int8 rows, int4 groups, int8 KV vectors ------------------------------------

def quantize_int8_reference(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The engine's `quant.quantize_int8`, as the exercise's (codes, scales) tuple."""
    from .quant import quantize_int8
    q = quantize_int8(w)
    return q.qweight, q.scales


def quantize_int4_reference(w: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The engine's `quant.quantize_int4`, as the exercise's (packed, scales, mins) tuple."""
    from .quant import quantize_int4
    q = quantize_int4(w, group_size)
    return q.qweight, q.scales, q.mins


def quantize_kv_int8_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What `kv_cache.Int8KVCache.append` stores for x [n_kv_heads, T, head_dim]: codes and [n_kv_heads, T] scales."""
    from .quant import quantize_int8
    n_kv, T, hd = x.shape
    q = quantize_int8(x.reshape(n_kv * T, hd))                             # one scale per vector
    return q.qweight.reshape(n_kv, T, hd), q.scales.reshape(n_kv, T)


def _expect_tuple(got, n: int, names: str) -> tuple:
    if not (isinstance(got, tuple) and len(got) == n):
        raise CaseFailed(f"returned {type(got).__name__}, expected a tuple ({names})")
    for name, a in zip(names.split(", "), got):
        if not isinstance(a, np.ndarray):
            raise CaseFailed(f"{name} is a {type(a).__name__}, expected a numpy array")
    return got


def _expect_int8_codes(w: np.ndarray, q, scales, want_q: np.ndarray, want_scales: np.ndarray,
                       scale_of: str) -> str:
    """Shared by exercises 08 and 10: int8 codes and their fp32 scales, one scale per `scale_of`."""
    if scales.shape != want_scales.shape:
        raise CaseFailed(f"scales has shape {list(scales.shape)}, expected {list(want_scales.shape)}: "
                         f"one scale per {scale_of}")
    if not np.all(np.isfinite(scales)):
        raise CaseFailed("scales has NaN/inf values")
    if not np.allclose(scales, want_scales, rtol=1e-5, atol=1e-12):
        flat = w.reshape(want_scales.size, -1)
        for wrong, hint in ((flat.max(axis=1) / 127, "the scale uses max(w); it is max(|w|): a vector whose "
                                                     "largest magnitude is negative must fit too"),
                            (np.abs(flat).max(axis=1) / 128, "divides by 128: the codes are -127..127, "
                                                             "so scale = max|w| / 127")):
            if np.allclose(scales.ravel(), wrong, rtol=1e-5, atol=1e-12):
                raise CaseFailed(hint)
        i = np.unravel_index(int(np.argmax(np.abs(scales - want_scales))), scales.shape)
        raise CaseFailed(f"scale of {scale_of} {list(map(int, i))} is {float(scales[i]):.6g}, expected "
                         f"{float(want_scales[i]):.6g} (= max |w| / 127 over that {scale_of})")
    if q.shape != want_q.shape:
        raise CaseFailed(f"codes have shape {list(q.shape)}, expected {list(want_q.shape)}")
    if q.dtype != np.int8:
        raise CaseFailed(f"codes are {q.dtype}; store them as np.int8, one byte each (that is the point)")
    diff = q.astype(np.int32) - want_q.astype(np.int32)
    if diff.any():
        # A code may differ by one only where w / scale lands on a rounding tie (x.5) within float error.
        safe = np.where(want_scales > 0, want_scales, 1.0)[..., None]
        exact = w.reshape(want_q.shape).astype(np.float64) / safe
        tie = np.abs(np.abs(exact - np.floor(exact)) - 0.5) < 1e-3
        bad = (diff != 0) & ~((np.abs(diff) == 1) & tie)
        if bad.any():
            i = tuple(int(a[0]) for a in np.nonzero(bad))
            raise CaseFailed(f"code at index {list(i)} is {int(q[i])}, expected {int(want_q[i])} "
                             f"(w = {float(w.reshape(want_q.shape)[i]):.6g}, scale {float(want_scales[i[:-1]]):.6g}: "
                             f"round(w / scale), clipped to -127..127)")
    return f"codes {list(q.shape)} and scales {list(scales.shape)} match"


# 08: int8 per output row ------------------------------------------------------------------------------

def _int8_cases() -> list[Case]:
    rng = np.random.default_rng(8)

    def normal(*shape, s=0.05):
        return (rng.standard_normal(shape) * s).astype(np.float32)
    negative = normal(4, 32)
    negative[1, 5] = -0.9                         # row 1's largest magnitude is negative
    zero_row = normal(3, 16)
    zero_row[2] = 0.0
    outlier = normal(2, 64)
    outlier[0, 7] = 5.0                           # one weight 100x the rest
    return [Case("8 rows of 64 weights", dict(w=normal(8, 64))),
            Case("SmolLM2's shape: q_proj [576, 576]", dict(w=normal(576, 576, s=0.03))),
            Case("non-square [3, 100]: one scale per row (output channel)", dict(w=normal(3, 100))),
            Case("a row whose largest |w| is negative", dict(w=negative)),
            Case("an all-zero row: scale 0, codes 0 (no NaN)", dict(w=zero_row)),
            Case("an outlier 100x the rest: the row's small weights round to few codes", dict(w=outlier))]


def _check_int8(fn, case: Case) -> str:
    w = case.inputs["w"]
    w_in = w.copy()
    got = _expect_tuple(fn(w_in), 2, "codes, scales")
    expect_unchanged("w", w, w_in)
    want_q, want_s = quantize_int8_reference(w)
    q, scales = got
    if scales.shape == (w.shape[1],) and w.shape[0] != w.shape[1]:
        raise CaseFailed(f"scales has shape {list(scales.shape)} (one per column); expected {[w.shape[0]]}: "
                         f"one scale per row, i.e. per output channel (max over axis 1)")
    return _expect_int8_codes(w, q, scales, want_q, want_s, "row")


# 09: int4 in groups, packed two a byte -------------------------------------------------------------

def _int4_cases() -> list[Case]:
    rng = np.random.default_rng(9)

    def normal(*shape, s=0.05, shift=0.0):
        return (rng.standard_normal(shape) * s + shift).astype(np.float32)
    return [Case("one row of 32 weights, groups of 32", dict(w=normal(1, 32), group_size=32)),
            Case("[8, 256] in groups of 128", dict(w=normal(8, 256), group_size=128)),
            Case("SmolLM2's width: [6, 576] in groups of 64", dict(w=normal(6, 576), group_size=64)),
            Case("in = 100, not a multiple of 64: pad the last group", dict(w=normal(4, 100), group_size=64)),
            Case("all weights positive (min > 0): the asymmetric grid starts at the min",
                 dict(w=np.abs(normal(3, 64)) + 0.2, group_size=32)),
            Case("a constant group: scale 0, codes 0 (no NaN)",
                 dict(w=np.concatenate([np.full((2, 32), 0.5, np.float32), normal(2, 32)], axis=1), group_size=32))]


def _check_int4(fn, case: Case) -> str:
    from .quant import unpack_int4
    w, g = case.inputs["w"], case.inputs["group_size"]
    w_in = w.copy()
    got = _expect_tuple(fn(w_in, g), 3, "packed, scales, mins")
    expect_unchanged("w", w, w_in)
    want_p, want_s, want_m = quantize_int4_reference(w, g)
    packed, scales, mins = got
    out_dim, in_dim = w.shape
    padded = want_p.shape[1] * 2
    if packed.shape != want_p.shape:
        if packed.shape == (out_dim, padded):
            raise CaseFailed(f"packed has shape {list(packed.shape)}: one code a byte; pack two a byte "
                             f"(expected {list(want_p.shape)})")
        if padded != in_dim and packed.shape[1] * 2 in (in_dim, in_dim - in_dim % g, in_dim + 1):
            raise CaseFailed(f"packed has shape {list(packed.shape)}, expected {list(want_p.shape)}: pad each row "
                             f"to a whole number of groups ({in_dim} -> {padded}) by repeating its last weight")
        raise CaseFailed(f"packed has shape {list(packed.shape)}, expected {list(want_p.shape)}")
    if packed.dtype != np.uint8:
        raise CaseFailed(f"packed is {packed.dtype}; it must be np.uint8 (two 4-bit codes in each byte)")
    for name, got_a, want_a in (("scales", scales, want_s), ("mins", mins, want_m)):
        if got_a.shape != want_a.shape:
            raise CaseFailed(f"{name} has shape {list(got_a.shape)}, expected {list(want_a.shape)}: one per group "
                             f"of {g} weights of a row")
        if got_a.dtype != np.float16:
            raise CaseFailed(f"{name} is {got_a.dtype}; store it as np.float16 (2 bytes a group)")
    # fp16 rounding of the scale and min may differ from the engine's by an ulp or two, no more.
    tol = dict(rtol=3e-3, atol=1e-4 * max(1e-3, float(np.abs(w).max())))
    if not np.allclose(mins.astype(np.float32), want_m.astype(np.float32), **tol):
        if np.allclose(mins.astype(np.float32), 0, atol=1e-6):
            raise CaseFailed("mins are all 0: the grid is asymmetric, each group starts at its own minimum")
        raise CaseFailed(f"mins differ from the groups' minimum: {_worst(mins, want_m)}")
    if not np.allclose(scales.astype(np.float32), want_s.astype(np.float32), **tol):
        raise CaseFailed(f"scales differ from (max - min) / 15 of each group: {_worst(scales, want_s)}")
    codes, want_codes = unpack_int4(packed), unpack_int4(want_p)              # [out, padded]
    diff = np.abs(codes.astype(np.int32) - want_codes)
    if (diff > 1).any() or diff.mean() > 0.05:
        swapped = unpack_int4(((packed & 0x0F) << 4 | packed >> 4).astype(np.uint8))
        if np.abs(swapped.astype(np.int32) - want_codes).max() <= 1:
            raise CaseFailed("the nibbles are swapped: element 2j goes in the LOW 4 bits of byte j, element "
                             "2j+1 in the HIGH 4 bits")
        r, j = (int(a[0]) for a in np.nonzero(diff > 1 if (diff > 1).any() else diff > 0))
        raise CaseFailed(f"code of row {r}, element {j} (group {j // g}) is {int(codes[r, j])}, expected "
                         f"{int(want_codes[r, j])}: round((w - min) / scale), clipped to 0..15")
    # Dequantized with the student's own scales and mins, every weight is within half a step.
    s = np.repeat(scales.astype(np.float32), g, axis=1)[:, :in_dim]
    m = np.repeat(mins.astype(np.float32), g, axis=1)[:, :in_dim]
    err = np.abs(codes[:, :in_dim] * s + m - w)
    if (err > 0.55 * s + 1e-6).any():
        r, j = (int(a[0]) for a in np.nonzero(err > 0.55 * s + 1e-6))
        raise CaseFailed(f"weight [{r}, {j}] comes back {err[r, j]:.3g} off, more than half its group's step "
                         f"{s[r, j]:.3g}: the grid [min, min + 15·scale] must cover the group")
    return f"packed {list(packed.shape)}, {scales.shape[1]} group(s) a row, max error {err.max():.2g} <= scale / 2"


def _worst(got: np.ndarray, want: np.ndarray) -> str:
    i = np.unravel_index(int(np.argmax(np.abs(got.astype(np.float32) - want.astype(np.float32)))), got.shape)
    return f"row {int(i[0])}, group {int(i[1])}: got {float(got[i]):.5g}, expected {float(want[i]):.5g}"


# 10: int8 KV cache vectors --------------------------------------------------------------------------

def _kv_int8_cases() -> list[Case]:
    rng = np.random.default_rng(10)

    def normal(*shape, s=1.0):
        return (rng.standard_normal(shape) * s).astype(np.float32)
    outlier = normal(3, 6, 64)
    outlier[1, 4] *= 20.0                         # one token of one head is 20x larger
    negative = normal(2, 3, 16)
    negative[0, 2, 9] = -40.0
    padding = normal(3, 5, 64)
    padding[:, 4] = 0.0
    return [Case("decode: one new position, 3 KV heads, head_dim 64 (SmolLM2)", dict(x=normal(3, 1, 64))),
            Case("prefill: 16 positions, 3 KV heads, head_dim 64", dict(x=normal(3, 16, 64, s=2.0))),
            Case("one token 20x larger: only its own scale grows", dict(x=outlier)),
            Case("a vector whose largest |x| is negative", dict(x=negative)),
            Case("an all-zero vector: scale 0, codes 0 (no NaN)", dict(x=padding)),
            Case("Mistral's shape: 8 KV heads, head_dim 128, 4 positions", dict(x=normal(8, 4, 128)))]


def _check_kv_int8(fn, case: Case) -> str:
    x = case.inputs["x"]
    x_in = x.copy()
    q, scales = _expect_tuple(fn(x_in), 2, "codes, scales")
    expect_unchanged("x", x, x_in)
    want_q, want_s = quantize_kv_int8_reference(x)
    n_kv, T, hd = x.shape
    if scales.shape == want_s.shape and T > 1:
        per_head = np.broadcast_to(np.abs(x).max(axis=(1, 2))[:, None] / 127, want_s.shape)
        if np.allclose(scales, per_head, rtol=1e-5) and not np.allclose(want_s, per_head, rtol=1e-5):
            raise CaseFailed("one scale per head for all positions: a large token then coarsens every token's "
                             "grid; give each (head, position) vector of head_dim values its own scale")
    if scales.shape in ((n_kv,), (T,), (hd,), (n_kv, hd), (T, hd)):
        raise CaseFailed(f"scales has shape {list(scales.shape)}, expected {[n_kv, T]}: one scale per "
                         f"(KV head, position), the max over head_dim")
    return _expect_int8_codes(x, q, scales, want_q, want_s, "(KV head, position) vector")


# 11: what crosses the bus between host and GPU -------------------------------------------------------

def transfer_bytes_reference(config, weight_bytes: int = 2) -> tuple[int, int, int]:
    """(upload, up per token, down per token): the bytes the engine's GPU path moves.

    GPUTransformer.from_cpu sends every matrix at `weight_bytes` and the norm gains as fp32 (a tied
    LM head is the embedding, sent once: ModelConfig.n_params counts it once); decode sets the step
    buffer [token, position] (two int32) and fetches the fp32 logits. The KV cache and activations are
    made on the device. Lesson 11 checks the upload against the arrays a GPUTransformer holds."""
    norms = (2 * config.n_layers + 1) * config.dim                        # gain values, fp32 on the device
    upload = (config.n_params - norms) * weight_bytes + norms * 4
    return upload, 2 * 4, config.vocab_size * 4


def _transfer_cases() -> list[Case]:
    from .config import PRESETS, ModelConfig
    preset = lambda name: PRESETS[name].config
    mqa = ModelConfig(vocab_size=1000, dim=64, n_layers=2, n_heads=4, n_kv_heads=1, ffn_dim=160)
    return [Case("SmolLM2-135M in fp16 (its LM head is tied to the embedding)",
                 dict(config=preset("smollm2-135m"), weight_bytes=2)),
            Case("Mistral-7B in fp16 (an untied LM head)", dict(config=preset("mistral-7b"), weight_bytes=2)),
            Case("Llama-3.2-1B in bf16 (tied, vocab 128256)", dict(config=preset("llama-3.2-1b"), weight_bytes=2)),
            Case("a tiny MQA model (1 KV head, untied), fp16", dict(config=mqa, weight_bytes=2)),
            Case("Llama-2-7B with fp32 weights (weight_bytes 4)", dict(config=preset("llama-2-7b"), weight_bytes=4))]


def _check_transfer(fn, case: Case) -> str:
    cfg, wb = case.inputs["config"], case.inputs["weight_bytes"]
    got = fn(cfg, wb)
    if not (isinstance(got, tuple) and len(got) == 3):
        raise CaseFailed(f"returned {type(got).__name__}, expected a tuple (upload, up_per_token, down_per_token)")
    try:
        upload, up, down = (int(v) for v in got)
    except (TypeError, ValueError):
        raise CaseFailed(f"returned {got!r}: expected three whole numbers of bytes") from None
    want_upload, want_up, want_down = transfer_bytes_reference(cfg, wb)
    norms, head = (2 * cfg.n_layers + 1) * cfg.dim, cfg.vocab_size * cfg.dim
    if upload != want_upload:
        hints = {want_upload + norms * (wb - 4): "the RMSNorm gains stay fp32 on the device (4 bytes a value), "
                                                 "whatever weight_bytes the matrices use",
                 want_upload - norms * 4: "the norm gains are sent too: two per layer and the final one, dim "
                                          "fp32 values each",
                 want_upload + cfg.kv_bytes_per_token(wb) * cfg.max_seq_len: "the KV cache is made on the device "
                                                                             "(cp.zeros): it never crosses the bus"}
        if cfg.tie_embeddings:
            hints[want_upload + head * wb] = "a tied LM head IS the embedding: one array, sent once"
        else:
            hints[want_upload - head * wb] = "an untied LM head is a matrix of its own: vocab × dim more weights"
        hints.pop(want_upload, None)
        raise CaseFailed(f"upload {upload:,} bytes, expected {want_upload:,}"
                         + (f": {hints[upload]}" if upload in hints else ""))
    if up != want_up:
        hint = {4: ": the position goes up with the token (GPUTransformer.decode sets step = [token, position])",
                16: ": two int32 values (4 bytes each), not int64"}.get(up, "")
        raise CaseFailed(f"up per token {up} bytes, expected {want_up}{hint}")
    if down != want_down:
        hint = ": the logits come back in fp32 (4 bytes each)" if down == cfg.vocab_size * 2 else (
            ": the host samples the next token, so it needs every logit (one id would come back only if "
            "sampling ran on the device)" if down in (4, 8) else "")
        raise CaseFailed(f"down per token {down:,} bytes, expected {want_down:,}{hint}")
    return f"upload {upload / 1e6:,.1f} MB once; per token {up} B up, {down:,} B down"


# 12: the order of a block's fp32 sum -----------------------------------------------------------------

def block_sum_reference(values: np.ndarray, n_threads: int = 256) -> np.ndarray:
    """Each row of values [rows, n] summed in fp32 in exactly the order of kernels/common.cuh's block_sum
    as rmsnorm.cu calls it: one block of n_threads (a multiple of 32, at most 1024) per row.  -> [rows]

    Lesson 12 checks this emulation against the GPU bit for bit."""
    v = np.asarray(values, dtype=np.float32)
    rows, n = v.shape
    acc = np.zeros((rows, n_threads), np.float32)              # one register per thread
    for start in range(0, n, n_threads):                       # thread t adds t, t + n_threads, ...
        chunk = v[:, start:start + n_threads]
        acc[:, :chunk.shape[1]] += chunk                       # threads past the row's end add nothing
    partial = _xor_shuffle_sum(acc.reshape(rows, n_threads // 32, 32))[..., 0]    # [rows, n_warps]
    return _warps_reduced(partial)


def _xor_shuffle_sum(lanes: np.ndarray) -> np.ndarray:
    """warp_sum over the last axis (32 lanes): five rounds of v += __shfl_xor_sync(v, o), o = 16 .. 1."""
    lane = np.arange(32)
    for o in (16, 8, 4, 2, 1):
        lanes = lanes + lanes[..., lane ^ o]                   # lane l adds lane l ^ o; all lanes at once
    return lanes


def _warps_reduced(partials: np.ndarray) -> np.ndarray:
    """Warp 0's second round over the per-warp totals [rows, n_warps]; its lanes past the last warp hold 0."""
    lanes = np.zeros((partials.shape[0], 32), np.float32)
    lanes[:, :partials.shape[1]] = partials
    return _xor_shuffle_sum(lanes)[:, 0]


def _block_sum_variants(v: np.ndarray, n_threads: int) -> dict[str, np.ndarray]:
    """Other orders of the same fp32 sum, each under the hint that names it (to explain a wrong answer)."""
    rows, n = v.shape
    sequential = np.zeros(rows, np.float32)
    for i in range(n):
        sequential = sequential + v[:, i]
    per = -(-n // n_threads)                                   # values per thread, rounded up
    padded = np.zeros((rows, n_threads * per), np.float32)
    padded[:, :n] = v
    contiguous = np.zeros((rows, n_threads), np.float32)
    for j in range(per):                                       # thread t adds t·per, t·per + 1, ...
        contiguous = contiguous + padded.reshape(rows, n_threads, per)[:, :, j]
    strided = np.zeros((rows, n_threads), np.float32)
    for j in range(per):                                       # the kernel's order within each thread
        strided = strided + padded.reshape(rows, per, n_threads)[:, j]
    partials = _xor_shuffle_sum(strided.reshape(rows, -1, 32))[..., 0]
    in_a_loop = np.zeros(rows, np.float32)
    for w in range(partials.shape[1]):
        in_a_loop = in_a_loop + partials[:, w]
    return {"NumPy's own order (pairwise summation), not the block's": v.sum(axis=1, dtype=np.float32),
            "one thread adding the row left to right (kernel v1's order), not the block's": sequential,
            "thread t adds a contiguous chunk; in the kernel thread t adds values t, t + n_threads, ... "
            "(a warp reads 32 neighbours at once: coalesced)":
                _warps_reduced(_xor_shuffle_sum(contiguous.reshape(rows, -1, 32))[..., 0]),
            "the per-warp totals are added in a loop; in the kernel warp 0 reduces them with the same xor "
            "tree (its lanes past the last warp hold 0)": in_a_loop}


def _block_sum_cases() -> list[Case]:
    rng = np.random.default_rng(12)

    def case(name, rows, n, n_threads, values=None):
        v = values if values is not None else rng.standard_normal((rows, n)).astype(np.float32)
        return Case(name, dict(values=v, n_threads=n_threads))
    squares = ((rng.standard_normal((16, 4096)) * 3) ** 2).astype(np.float32)
    mixed = (rng.standard_normal((32, 1000)) * np.where(rng.random((32, 1000)) < 0.1, 1e4, 1e-3)).astype(np.float32)
    return [case("one warp: 32 threads, 32 values a row (only the shuffle tree)", 8, 32, 32),
            case("Mistral's dim: the squares of 4096 activations over 256 threads (rmsnorm.cu)", 16, 4096, 256,
                 squares),
            case("SmolLM2's dim 576 over 256 threads: threads 0-63 add 3 values, the others 2", 16, 576, 256),
            case("fewer values than threads: 100 over 256 (idle threads hold 0)", 8, 100, 256),
            case("1024 threads (32 warps) over 14336 values: warp 0 reduces a full warp of totals", 8, 14336, 1024),
            case("magnitudes 1e-3 and 1e4 mixed, 128 threads: the order decides the last bits", 32, 1000, 128, mixed)]


def _check_block_sum(fn, case: Case) -> str:
    v, n_threads = case.inputs["values"], case.inputs["n_threads"]
    v_in = v.copy()
    got = fn(v_in, n_threads)
    expect_unchanged("values", v, v_in)
    want = block_sum_reference(v, n_threads)
    if not isinstance(got, np.ndarray) or got.shape != want.shape:
        raise CaseFailed(f"returned {getattr(got, 'shape', type(got).__name__)}, expected a float32 array of "
                         f"shape {list(want.shape)} (one sum per row)")
    if got.dtype != np.float32:
        raise CaseFailed(f"returned {got.dtype}: the kernel adds in float32, and the bits depend on it")
    exact = v.astype(np.float64).sum(axis=1)
    off = np.abs(got - exact) > 1e-5 * np.abs(v).astype(np.float64).sum(axis=1) + 1e-30
    if off.any():
        r = int(np.argmax(off))
        raise CaseFailed(f"row {r}: {float(got[r]):.7g} is not the row's sum ({exact[r]:.7g} in float64)")
    differ = got.view(np.uint32) != want.view(np.uint32)
    if differ.any():
        for hint, other in _block_sum_variants(v, n_threads).items():
            if np.array_equal(got.view(np.uint32), other.view(np.uint32)):
                raise CaseFailed(f"the right sums in another order: {hint}")
        r = int(np.argmax(differ))
        raise CaseFailed(f"{int(differ.sum())} of {len(want)} rows differ in the last bits, e.g. row {r}: "
                         f"{float(got[r])!r} vs the block's {float(want[r])!r}: right to fp32 precision, "
                         f"added in another order (see the docstring's three steps)")
    return f"{len(want)} row sums, bit-identical to the block's order"


# 13: kernel launches per decoded token ---------------------------------------------------------------

def record_decode_launches(config, gemv_version: int = 4, fuse_norm: bool = True,
                           capacity: int = 256) -> list[str]:
    """The kernel launches of one GPUTransformer decode step, in order ("embed", "gemv_v4 o", ...),
    recorded on the CPU by `recording_decode_step`."""
    step, launches = recording_decode_step(config, gemv_version, fuse_norm, capacity)
    step()
    return launches


def recording_decode_step(config, gemv_version: int = 4, fuse_norm: bool = True,
                          capacity: int = 256) -> tuple[Callable[[], None], list[str]]:
    """(step, launches): step() runs the engine's own `GPUTransformer.decode_step` on the CPU and
    appends the name of each kernel it would launch to `launches`.

    Its `Kernels` records each launch through the `timer` hook (the one the selfcheck times kernels
    with) instead of running it, and every array is a shape-only NumPy view (np.broadcast_to: no
    memory). No GPU, no CuPy: everything the engine's Python does per launch runs, the launch does not."""
    from collections import defaultdict

    from .cuda.gpu_model import GPUKVCache, GPULayer, GPUTransformer
    from .cuda.kernels import Kernels, n_splits_for

    def shaped(*shape, dtype=np.float32):
        return np.broadcast_to(np.zeros((), dtype), shape)

    launches: list[str] = []
    k = Kernels.__new__(Kernels)                       # no __init__: nothing to compile, no CuPy
    k.dtype, k.fn = "float16", defaultdict(lambda: None)
    k._nil_f32 = k._nil_u16 = k._nil_i32 = None
    k.timer = lambda name, launch: launches.append(name)           # record; never call launch()
    c, hd, w16 = config, config.head_dim, np.float16
    m = GPUTransformer.__new__(GPUTransformer)
    m.config, m.k, m.dtype, m.use_graph, m.quant = c, k, "float16", False, None     # 16-bit weights
    m.gemv_version, m.fuse_norm = gemv_version, fuse_norm
    m.q_width, m.qkv_width = c.n_heads * hd, (c.n_heads + 2 * c.n_kv_heads) * hd
    m.layers = [GPULayer(shaped(c.dim), shaped(m.qkv_width, c.dim, dtype=w16), shaped(c.dim, m.q_width, dtype=w16),
                         shaped(c.dim), shaped(2 * c.ffn_dim, c.dim, dtype=w16), shaped(c.dim, c.ffn_dim, dtype=w16))
                for _ in range(c.n_layers)]
    m.embed = shaped(c.vocab_size, c.dim, dtype=w16)
    m.lm_head = m.embed if c.tie_embeddings else shaped(c.vocab_size, c.dim, dtype=w16)
    m.final_norm, m.inv_freq = shaped(c.dim), shaped(hd // 2)
    m.step = shaped(2, dtype=np.int32)
    m.step_tokens, m.step_pos = m.step[0:1], m.step[1:2]
    m.x, m.h, m.qkv, m.attn = shaped(1, c.dim), shaped(1, c.dim), shaped(1, m.qkv_width), shaped(1, m.q_width)
    m.gu, m.act, m.logits = shaped(1, 2 * c.ffn_dim), shaped(1, c.ffn_dim), shaped(c.vocab_size)
    s = n_splits_for(c.n_heads, capacity)
    parts = (shaped(1, c.n_heads, s), shaped(1, c.n_heads, s), shaped(1, c.n_heads, s, hd),
             shaped(1, c.n_heads, dtype=np.uint32))
    m._decode_parts = lambda cache: parts              # the engine's allocates on the device
    cache = GPUKVCache.__new__(GPUKVCache)
    cache.k = cache.v = shaped(c.n_layers, c.n_kv_heads, capacity, hd, dtype=w16)
    cache.max_seq_len, cache.length = capacity, 0
    return (lambda: m.decode_step(cache)), launches


def decode_launches_reference(config, gemv_version: int, fuse_norm: bool) -> int:
    """Kernel launches per decoded token, counted by running the engine's decode step (above)."""
    return len(record_decode_launches(config, gemv_version, fuse_norm))


def _launch_cases() -> list[Case]:
    from .config import PRESETS, ModelConfig
    smol, mistral = PRESETS["smollm2-135m"].config, PRESETS["mistral-7b"].config
    wide = ModelConfig(vocab_size=1000, dim=16384, n_layers=2, n_heads=128, n_kv_heads=8, ffn_dim=2048)
    tiny = ModelConfig(vocab_size=512, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=128)

    def case(name, config, version, fuse):
        return Case(name, dict(config=config, gemv_version=version, fuse_norm=fuse))
    return [case("SmolLM2-135M, gemv v4, norms fused (the engine's default)", smol, 4, True),
            case("Mistral-7B, gemv v4, norms fused", mistral, 4, True),
            case("Mistral-7B, gemv v4, separate RMSNorm launches (fuse_norm off)", mistral, 4, False),
            case("Mistral-7B, gemv v2, nothing fused (the first version)", mistral, 2, False),
            case("SmolLM2-135M, gemv v2 with the norm fused into the GEMV (v3)", smol, 2, True),
            case("a 16384-wide model, gemv v2 + fuse_norm: v3 holds x in shared memory", wide, 2, True),
            case("gemv v1, 3 layers: the same launches as v2", tiny, 1, False)]


def _check_launches(fn, case: Case) -> str:
    import dataclasses

    from .cuda.kernels import MAX_FUSED_NORM
    cfg, version, fuse = case.inputs["config"], case.inputs["gemv_version"], case.inputs["fuse_norm"]
    got = fn(cfg, version, fuse)
    if isinstance(got, bool) or not isinstance(got, (int, np.integer)):
        raise CaseFailed(f"returned {got!r}, expected a whole number of launches")
    recorded = record_decode_launches(cfg, version, fuse)
    want = len(recorded)
    if got == want:
        return f"{want} launches ({', '.join(sorted({name.split()[0] for name in recorded}))})"
    if version < 4 and fuse and cfg.dim > MAX_FUSED_NORM:
        narrow = dataclasses.replace(cfg, dim=8 * (MAX_FUSED_NORM // 8))
        if got == decode_launches_reference(narrow, version, fuse):
            raise CaseFailed(f"{got}, expected {want}: below gemv v4, fuse_norm uses gemv.cu v3, which keeps x in "
                             f"shared memory and fuses only when dim <= MAX_FUSED_NORM ({MAX_FUSED_NORM}); at dim "
                             f"{cfg.dim} every RMSNorm stays its own launch (GPUTransformer._fused)")
    outside = record_decode_launches(dataclasses.replace(cfg, n_layers=0), version, fuse)
    one = record_decode_launches(dataclasses.replace(cfg, n_layers=1), version, fuse)
    per_layer = len(one) - len(outside)
    first = next(i for i in range(len(outside) + 1) if one[:i] + one[i + per_layer:] == outside)
    layer = one[first:first + per_layer]
    if (got - len(outside)) % cfg.n_layers == 0:
        raise CaseFailed(f"{got}, expected {want}: each of the {cfg.n_layers} layers launches {per_layer} kernels "
                         f"({', '.join(layer)}); your count implies {(got - len(outside)) // cfg.n_layers}")
    raise CaseFailed(f"{got}, expected {want}: outside the layers the step launches {len(outside)} "
                     f"({', '.join(outside)}), and each layer {per_layer}")


# 15: FlashNorm, the gain folded into the next projection ----------------------------------------------

def fold_rmsnorm_reference(gain: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The engine's `flashnorm.fold_rmsnorm_into_linear`."""
    from .flashnorm import fold_rmsnorm_into_linear
    return fold_rmsnorm_into_linear(gain, w)


def _fold_cases() -> list[Case]:
    rng = np.random.default_rng(15)

    def case(name, out, n_in, spread=0.3):
        w = (rng.standard_normal((out, n_in)) * 0.05).astype(np.float32)
        gain = (1.0 + spread * rng.standard_normal(n_in)).astype(np.float32)
        return Case(name, dict(w=w, gain=gain))
    return [case("square [64, 64]: rows or columns?", 64, 64),
            case("SmolLM2's q_proj [576, 576]", 576, 576),
            case("gate_proj shape [1536, 576]: out != in", 1536, 576),
            case("k_proj shape [192, 576] with large gains (spread 2)", 192, 576, spread=2.0),
            case("one output row [1, 32]", 1, 32)]


def _check_fold(fn, case: Case) -> str:
    from .layers import rmsnorm
    w, gain = case.inputs["w"], case.inputs["gain"]
    w_in, gain_in = w.copy(), gain.copy()
    got = fn(gain_in, w_in)
    expect_unchanged("w", w, w_in)
    expect_unchanged("gain", gain, gain_in)
    want = fold_rmsnorm_reference(gain, w)
    if isinstance(got, np.ndarray) and got.shape == want.shape and not np.allclose(got, want, rtol=1e-4, atol=1e-7):
        for wrong, hint in ((w * gain[:, None] if w.shape[0] == w.shape[1] else None,
                             "scaled the rows of W: the gain multiplies input channels, i.e. the columns of "
                             "W in [out, in] layout (W * gain[None, :])"),
                            (w / gain[None, :], "divided by the gain; folding multiplies W's columns by it"),
                            (w * gain[None, :] ** 2, "multiplied by gain twice")):
            if wrong is not None and np.allclose(got, wrong, rtol=1e-4, atol=1e-7):
                raise CaseFailed(hint)
    summary = expect_close("W*", got, want)
    x = np.random.default_rng(w.shape[0]).standard_normal((3, w.shape[1])).astype(np.float32) * 2
    expect_close("rmsnorm(x, ones) @ W*.T", rmsnorm(x, np.ones_like(gain), 1e-5) @ got.T, rmsnorm(x, gain, 1e-5) @ w.T)
    return summary + "; rmsnorm(x, gain) @ W.T == rmsnorm(x, ones) @ W*.T"


def _reference(name: str) -> Callable:
    def ref(*args, **kwargs):
        from . import attention, kv_heads, layers, mla, sampling
        return {"rmsnorm": layers.rmsnorm, "apply_rope": layers.apply_rope,
                "top_p_filter": sampling.top_p_filter, "pool_heads": kv_heads.pool_heads,
                "absorbed_attention": mla.absorbed_attention,
                "attention_mask": attention.attention_mask}[name](*args, **kwargs)
    ref.__qualname__ = f"minillm reference {name}"
    return ref


# 14: int4 codes as the GPU kernel reads them: 32-bit words ---------------------------------------------

def dequantize_int4_words_reference(words: np.ndarray, scales: np.ndarray, mins: np.ndarray,
                                    in_features: int) -> np.ndarray:
    """W fp32 [out, in_features] from minillm.quant's int4 layout with the packed bytes read 4 at a time as
    little-endian 32-bit words (what kernels/gemv_quant.cu's 16-byte loads hold): the engine's
    Int4Weight.dequantize on the same bytes."""
    from .quant import Int4Weight
    packed = np.ascontiguousarray(words).astype("<u4").view(np.uint8).reshape(words.shape[0], -1)
    return Int4Weight(packed, scales, mins, in_features).dequantize()


def _int4_words(rows: int, cols: int, group: int, seed: int, codes: np.ndarray | None = None) -> dict:
    from .quant import Int4Weight, pack_int4, quantize_int4
    rng = np.random.default_rng(seed)
    q = quantize_int4((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), group)
    if codes is not None:                                  # chosen codes, to expose the order of the nibbles
        q = Int4Weight(pack_int4(codes), q.scales, q.mins, cols)
    return dict(words=q.qweight.view("<u4").copy(), scales=q.scales.copy(), mins=q.mins.copy(), in_features=cols)


def _int4_word_cases() -> list[Case]:
    ramp = np.tile(np.arange(32, dtype=np.uint8) % 16, (2, 2))                   # codes 0, 1, ..., 15, 0, ... [2, 64]
    return [Case("one row, one group of 32 (SmolLM2's Q4_1 grid)", _int4_words(1, 32, 32, 1)),
            Case("codes 0, 1, 2, ..., 15 in order: which nibble is element 0?", _int4_words(2, 64, 32, 2, ramp)),
            Case("4 rows x 256, groups of 128 (the engine's default)", _int4_words(4, 256, 128, 3)),
            Case("in = 200 in groups of 64: the last group is padded, drop columns past in_features",
                 _int4_words(3, 200, 64, 4)),
            Case("3 rows of SmolLM2's width 576 in groups of 128 (4.5 groups)", _int4_words(3, 576, 128, 5))]


def _int4_words_variant(words, scales, mins, in_features, swap_nibbles=False, big_endian=False):
    """The classic wrong readings of the words, for hints."""
    b = np.ascontiguousarray(words).astype(">u4" if big_endian else "<u4").view(np.uint8).reshape(words.shape[0], -1)
    if swap_nibbles:
        b = ((b & 0x0F) << 4) | (b >> 4)
    return dequantize_int4_words_reference(b.view("<u4"), scales, mins, in_features)


def _check_int4_words(fn, case: Case) -> str:
    c = case.inputs
    inputs = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in c.items()}
    got = fn(inputs["words"], inputs["scales"], inputs["mins"], inputs["in_features"])
    for name in ("words", "scales", "mins"):
        expect_unchanged(name, c[name], inputs[name])
    want = dequantize_int4_words_reference(c["words"], c["scales"], c["mins"], c["in_features"])
    if isinstance(got, np.ndarray) and got.shape == want.shape and not np.allclose(got, want, rtol=1e-5, atol=1e-7):
        for kw, hint in ((dict(swap_nibbles=True), "element 2j is the LOW nibble of byte j (bits 0-3), element "
                                                    "2j+1 the high one: nibble i of a word is element i"),
                         (dict(big_endian=True), "the words are little-endian: byte 0 (elements 0 and 1) is the "
                                                 "least significant byte, bits 0-7")):
            if np.allclose(got, _int4_words_variant(**c, **kw), rtol=1e-5, atol=1e-7):
                raise CaseFailed(hint)
    return expect_close("W", got, want, rtol=1e-5, atol=1e-7)


# 16-18: many users: the paged pool, the packed batch, the prefix cache -----------------------------

def gather_reference(pool: np.ndarray, block_table, length: int) -> np.ndarray:
    """The engine's PagedKVCache.read for one layer's pool given by the caller.   -> [n_kv, length, hd]"""
    from .config import ModelConfig
    from .paged_kv import PagedKVCache
    n_blocks, block_size, n_kv, hd = pool.shape
    shape = ModelConfig(vocab_size=1, dim=n_kv * hd, n_layers=1, n_heads=n_kv, n_kv_heads=n_kv, ffn_dim=1,
                        head_dim=hd)
    paged = PagedKVCache(shape, 0, block_size)
    paged.k = paged.v = pool[None]                       # the caller's pool as layer 0 (no copy)
    return paged.read(0, list(block_table), length)[0]


def _gather_cases() -> list[Case]:
    def case(name, n_blocks, bs, n_kv, hd, table, length):
        return Case(name, dict(n_blocks=n_blocks, bs=bs, n_kv=n_kv, hd=hd, table=table, length=length))
    return [case("a table in order: blocks 0, 1, 2 of 4 positions, 12 positions", 6, 4, 2, 8, [0, 1, 2], 12),
            case("a scattered table [5, 2, 7]: the table decides the order", 8, 4, 2, 8, [5, 2, 7], 12),
            case("the last block partly filled: 10 positions in 3 blocks of 4", 8, 4, 2, 8, [6, 0, 3], 10),
            case("a table with more blocks than needed: 6 positions, 4 blocks listed", 8, 4, 3, 4, [3, 1, 4, 0], 6),
            case("one position", 4, 4, 1, 8, [2], 1),
            case("SmolLM2's heads: 3 KV heads, head_dim 64, blocks of 16, 40 positions", 10, 16, 3, 64, [9, 4, 7], 40)]


def _check_gather(fn, case: Case) -> str:
    c = case.inputs
    rng = np.random.default_rng(c["n_blocks"] * 7 + c["length"])
    pool = rng.standard_normal((c["n_blocks"], c["bs"], c["n_kv"], c["hd"])).astype(np.float32)
    pool_in = pool.copy()
    got = fn(pool_in, list(c["table"]), c["length"])
    expect_unchanged("pool", pool, pool_in)
    want = gather_reference(pool, c["table"], c["length"])
    length, n_kv, hd = c["length"], c["n_kv"], c["hd"]
    if isinstance(got, np.ndarray) and got.shape == (length, n_kv, hd) and n_kv != length:
        raise CaseFailed(f"returned [length, n_kv_heads, head_dim] = {list(got.shape)}; attention wants the "
                         f"heads first: transpose to {list(want.shape)}")
    if isinstance(got, np.ndarray) and got.shape[:1] == (n_kv,) and got.ndim == 3 and got.shape[1] > length:
        raise CaseFailed(f"returned {got.shape[1]} positions: cut the gathered blocks to the first {length}")
    if isinstance(got, np.ndarray) and got.shape == want.shape and c["table"] != sorted(c["table"]):
        in_order = gather_reference(pool, list(range(len(c["table"]))), length)
        if np.array_equal(got, in_order):
            raise CaseFailed("read blocks 0, 1, 2, ... of the pool; read the blocks the table names, in its order")
    return expect_close("keys", got, want, rtol=0, atol=0)


def pack_reference(chunks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The engine's batched.pack for (token_ids, start) pairs."""
    from .batched import SeqChunk, pack
    return pack([SeqChunk(list(tokens), start, []) for tokens, start in chunks])


def _pack_cases() -> list[Case]:
    rng = np.random.default_rng(17)

    def toks(n):
        return rng.integers(0, 1000, n).tolist()
    return [Case("one prompt of 5 tokens", dict(chunks=[(toks(5), 0)])),
            Case("a decode step of 3 sequences at positions 37, 5, 120", dict(chunks=[([7], 37), ([8], 5), ([9], 120)])),
            Case("mixed: a prompt, a decode, and a prompt's second chunk from position 8",
                 dict(chunks=[(toks(5), 0), ([3], 37), (toks(12), 8)])),
            Case("a one-token prompt first", dict(chunks=[([42], 0), (toks(4), 0)])),
            Case("a long chunk between two decodes", dict(chunks=[([1], 99), (toks(30), 16), ([2], 3)]))]


def _check_pack(fn, case: Case) -> str:
    chunks = case.inputs["chunks"]
    got = _expect_tuple(fn([(list(t), s) for t, s in chunks]), 3, "tokens, positions, last_rows")
    tokens, positions, last_rows = pack_reference(chunks)
    for name, g, w in (("tokens", got[0], tokens), ("positions", got[1], positions)):
        if g.shape != w.shape or not np.array_equal(g, w):
            if name == "positions" and g.shape == w.shape:
                if np.array_equal(g, np.arange(len(w))):
                    raise CaseFailed("positions count through the whole batch; each sequence has its own positions, "
                                     "from its chunk's `start`")
                if np.array_equal(g, np.concatenate([np.arange(len(t)) for t, _ in chunks])):
                    raise CaseFailed("positions restart at 0 for every chunk; they continue from the chunk's `start` "
                                     "(the positions already in the cache)")
            raise CaseFailed(f"{name} {g.tolist()[:12]} != expected {w.tolist()[:12]}")
    if last_rows.shape == got[2].shape and np.array_equal(got[2], last_rows + 1):
        raise CaseFailed("last_rows are one past each chunk's end: the last token of a chunk ending at row "
                         "r (exclusive) is row r - 1")
    if got[2].shape != last_rows.shape or not np.array_equal(got[2], last_rows):
        raise CaseFailed(f"last_rows {got[2].tolist()} != expected {last_rows.tolist()}")
    return f"{len(tokens)} tokens of {len(chunks)} sequences; last rows {last_rows.tolist()}"


def cached_prefix_reference(prompt: list[int], cached: list[list[int]], block_size: int) -> int:
    """What the engine's scheduler reuses: the PrefixCache's longest run of hashed full blocks."""
    from .prefix_cache import PrefixCache, block_hashes
    cache = PrefixCache()
    for i, seq in enumerate(cached):
        for j, h in enumerate(block_hashes(seq, block_size)):
            cache.insert(h, i * 100_000 + j)             # every cached sequence's full blocks
    n_blocks = (len(prompt) - 1) // block_size           # the last token is always computed
    return len(cache.match(block_hashes(prompt, block_size)[:n_blocks])) * block_size


def _prefix_cases() -> list[Case]:
    rng = np.random.default_rng(18)

    def toks(n):
        return rng.integers(100, 1000, n).tolist()
    system, other = toks(40), toks(40)
    long_chat = system + toks(30)
    return [Case("nothing cached", dict(prompt=toks(20), cached=[], block_size=16)),
            Case("a cached 40-token system prompt, blocks of 16: its 2 full blocks",
                 dict(prompt=system + toks(10), cached=[system], block_size=16)),
            Case("the same block of tokens after a different start is no match",
                 dict(prompt=other[:16] + system[16:40] + toks(5), cached=[system], block_size=16)),
            Case("block 2 equals another sequence's block 2, after a different block 1: no match past block 1",
                 dict(prompt=system[:16] + other[16:32] + toks(9), cached=[system, other], block_size=16)),
            Case("the prompt is a cached sequence: its last token is computed again",
                 dict(prompt=system[:32], cached=[system[:32]], block_size=16)),
            Case("a divergence inside a block: only the blocks before it",
                 dict(prompt=system[:21] + toks(20), cached=[system], block_size=4)),
            Case("two cached sequences: the longer match counts",
                 dict(prompt=long_chat + toks(3), cached=[system, long_chat, other], block_size=8)),
            Case("the prompt runs past the end of a cached sequence: that sequence's full blocks",
                 dict(prompt=system + toks(20), cached=[system], block_size=16))]


def _check_prefix(fn, case: Case) -> str:
    c = case.inputs
    got = fn(list(c["prompt"]), [list(s) for s in c["cached"]], c["block_size"])
    want = cached_prefix_reference(c["prompt"], c["cached"], c["block_size"])
    if not isinstance(got, (int, np.integer)):
        raise CaseFailed(f"returned {type(got).__name__}, expected an int (a number of tokens)")
    if got == want:
        return f"{want} tokens reused"
    prompt, bs = c["prompt"], c["block_size"]
    common = max([_common_prefix(prompt, s) for s in c["cached"]] + [0])
    if got == (common // bs) * bs and got > want:
        raise CaseFailed(f"returned {got}: the prompt's last token must always be computed (its logits give the "
                         f"first new token), so at most {(len(prompt) - 1) // bs} blocks: expected {want}")
    if got == min(common, len(prompt) - 1) or got == common:
        raise CaseFailed(f"returned {got}, the tokens in common; only whole blocks are reused: {want}")
    if got % bs:
        raise CaseFailed(f"returned {got}, not a multiple of block_size {bs}: blocks are reused whole")
    raise CaseFailed(f"returned {got}, expected {want}")


def _common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# 19: reading a streamed answer (server-sent events) ---------------------------------------------------

def stream_text_reference(body: str) -> tuple[str, str | None]:
    """The engine's own SSE reader: minillm.serve_client_bench.stream_text (`minillm bench serve --url`)."""
    from .serve_client_bench import stream_text
    return stream_text(body)


def _sse_body(chunks: list[dict], newline: str = "\n", comments: bool = False) -> str:
    """A streamed response body as a server writes it: `data: <json>` events, each ended by a blank line."""
    import json
    events = [f"data: {json.dumps(c)}" for c in chunks] + ["data: [DONE]"]
    if comments:                                     # proxies and servers send these to keep a connection open
        events[1:1] = [": keep-alive"]
        events.insert(0, ": keep-alive")
    return "".join(e + newline + newline for e in events)


def _completion_chunks(pieces: list[str], finish: str) -> list[dict]:
    def chunk(text, reason=None):
        return {"id": "cmpl-19", "object": "text_completion",
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]}
    return [chunk(p) for p in pieces] + [chunk("", finish)]


def _chat_chunks(pieces: list[str], finish: str) -> list[dict]:
    def chunk(delta, reason=None):
        return {"id": "chatcmpl-19", "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}
    return [chunk({"role": "assistant", "content": ""})] + [chunk({"content": p}) for p in pieces] + [chunk({}, finish)]


def _sse_cases() -> list[Case]:
    usage = {"id": "cmpl-19", "object": "text_completion", "choices": [],
             "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}}
    return [Case("completions: the text is in choices[0].text",
                 dict(body=_sse_body(_completion_chunks(["Once", " upon", " a"], "length")))),
            Case("chat: a role chunk first, then the text in choices[0].delta.content",
                 dict(body=_sse_body(_chat_chunks(["Hello", " there", "!"], "stop")))),
            Case("a usage chunk with no choices before [DONE] (stream_options.include_usage)",
                 dict(body=_sse_body(_completion_chunks(["The", " sky"], "length") + [usage]))),
            Case("CRLF line endings and ': keep-alive' comment lines",
                 dict(body=_sse_body(_chat_chunks(["a", "b", "c"], "stop"), newline="\r\n", comments=True))),
            Case("newlines, quotes and non-ASCII text, escaped inside the JSON",
                 dict(body=_sse_body(_chat_chunks(["line 1\n", 'a "quote"', " café ☕"], "stop")))),
            Case("an empty answer: only the role chunk and the finish chunk",
                 dict(body=_sse_body(_chat_chunks([], "stop"))))]


def _check_sse(fn, case: Case) -> str:
    body = case.inputs["body"]
    got = fn(body)
    want_text, want_finish = stream_text_reference(body)
    if not (isinstance(got, tuple) and len(got) == 2):
        raise CaseFailed(f"returned {type(got).__name__} {_clip(got)}, expected a tuple (text, finish_reason)")
    text, finish = got
    if text != want_text:
        raise CaseFailed(f"text {_clip(text)} != expected {_clip(want_text)}")
    if finish != want_finish:
        raise CaseFailed(f"finish_reason {finish!r} != expected {want_finish!r} (the last one a chunk carries)")
    return f"text {_clip(want_text)}, finish_reason {want_finish!r}"


def _clip(value, n: int = 48) -> str:
    r = repr(value)
    return r if len(r) <= n else r[:n - 3] + "..."


EXERCISES: dict[int, Exercise] = {e.number: e for e in [
    Exercise(1, "rmsnorm", 1, _reference("rmsnorm"), _rmsnorm_cases, _check_rmsnorm),
    Exercise(2, "kv_cache_update", 2, kv_cache_update_reference, _kv_cases, _check_kv),
    Exercise(3, "apply_rope", 3, _reference("apply_rope"), _rope_cases, _check_rope),
    Exercise(4, "top_p_filter", 4, _reference("top_p_filter"), _top_p_cases, _check_top_p),
    Exercise(5, "mean_pool_kv_heads", 5, _reference("pool_heads"), _pool_cases, _check_pool),
    Exercise(6, "absorbed_attention", 6, _reference("absorbed_attention"), _mla_cases, _check_mla),
    Exercise(7, "sliding_window_mask", 7, _reference("attention_mask"), _mask_cases, _check_mask),
    Exercise(8, "quantize_int8_per_row", 8, quantize_int8_reference, _int8_cases, _check_int8),
    Exercise(9, "quantize_int4_groupwise", 9, quantize_int4_reference, _int4_cases, _check_int4),
    Exercise(10, "quantize_kv_int8", 10, quantize_kv_int8_reference, _kv_int8_cases, _check_kv_int8),
    Exercise(11, "transfer_bytes", 11, transfer_bytes_reference, _transfer_cases, _check_transfer),
    Exercise(12, "block_sum", 12, block_sum_reference, _block_sum_cases, _check_block_sum),
    Exercise(13, "decode_launches", 13, decode_launches_reference, _launch_cases, _check_launches),
    Exercise(14, "dequantize_int4_words", 14, dequantize_int4_words_reference, _int4_word_cases, _check_int4_words),
    Exercise(15, "fold_rmsnorm_into_linear", 15, fold_rmsnorm_reference, _fold_cases, _check_fold),
    Exercise(16, "gather_through_block_table", 16, gather_reference, _gather_cases, _check_gather),
    Exercise(17, "pack_batch", 17, pack_reference, _pack_cases, _check_pack),
    Exercise(18, "cached_prefix_tokens", 18, cached_prefix_reference, _prefix_cases, _check_prefix),
    Exercise(19, "stream_text", 19, stream_text_reference, _sse_cases, _check_sse),
]}
