"""Finding and running the lessons, and what every lesson shares: its model, its tables, its plots.

Lessons live in `lessons/NN_name.py` of a source checkout. Environment variables the lessons honour:
    MINILLM_LESSON_MODEL   a preset, a weights folder or a .gguf (default smollm2-135m, pulled on
                           first use), or `random:PRESET` for random weights of that preset's shape
    MINILLM_LESSON_QUICK   1: tiny sizes, so a lesson runs in seconds (the smoke tests use it)
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from minillm.errors import MiniLLMError
from minillm.resources import data_dir, import_root, install_hint

LESSONS_DIR = data_dir("lessons")          # the checkout's lessons/, or an installed wheel's copy
EXERCISES_DIR = LESSONS_DIR / "exercises"
MODEL_ENV, QUICK_ENV = "MINILLM_LESSON_MODEL", "MINILLM_LESSON_QUICK"
OUT_ENV = "MINILLM_LESSON_OUT"             # where plots go instead of lessons/out/ (the tests: a temporary folder)
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
    if not LESSONS_DIR.is_dir():
        raise MiniLLMError(f"the lessons are not installed here: no folder {LESSONS_DIR} (they come with a source "
                           f"checkout, and with a wheel built from one)")
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


def run_lesson(number: int, quick: bool = False, model: str | None = None, args=()) -> int:
    """Run lesson `number` as its own process (as `python lessons/NN_name.py ARGS` would); its exit code."""
    lesson = find_lesson(number)
    env = dict(os.environ)
    if quick:
        env[QUICK_ENV] = "1"
    if model is not None:
        env[MODEL_ENV] = model
    # The checkout's minillm first, so an uninstalled checkout runs its own engine.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(import_root()), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, str(lesson.path), *args], env=env).returncode


# ---- what a lesson asks and gives: its ABOUT ------------------------------------------------------

# Every lesson opens with a module-level ABOUT dict of these keys, read here without running the lesson.
ABOUT_FIELDS = {"prerequisites": "before you start", "objectives": "you will be able to",
                "study_time": "study time", "check_questions": "check yourself", "try_this": "try this"}


def lesson_about(lesson: Lesson) -> dict:
    """The lesson's ABOUT dict, read from its source with ast (the lesson is not run); MiniLLMError when it
    is missing or malformed."""
    import ast
    tree = ast.parse(lesson.path.read_text(encoding="utf-8"), str(lesson.path))
    node = next((n.value for n in tree.body if isinstance(n, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == "ABOUT" for t in n.targets)), None)
    where = f"lesson {lesson.number:02d} ({lesson.path.name})"
    if node is None:
        raise MiniLLMError(f"{where} has no module-level ABOUT dict (prerequisites, objectives, ...)")
    try:
        about = ast.literal_eval(node)
    except ValueError:
        raise MiniLLMError(f"{where}: ABOUT must be a plain literal (strings and lists)") from None
    missing = [k for k in ABOUT_FIELDS if not about.get(k)] if isinstance(about, dict) else list(ABOUT_FIELDS)
    if missing:
        raise MiniLLMError(f"{where}: ABOUT lacks {', '.join(missing)}")
    if not 2 <= len(about["check_questions"]) <= 3:
        raise MiniLLMError(f"{where}: ABOUT has {len(about['check_questions'])} check questions (2 or 3)")
    return about


def format_about(lesson: Lesson) -> str:
    """`minillm lesson N --about`: the title, then each ABOUT field as a short list."""
    about = lesson_about(lesson)
    out = [lesson.title, ""]
    for key, heading in ABOUT_FIELDS.items():
        value = about[key]
        if isinstance(value, str):
            out.append(f"{heading}: {value}")
            continue
        out.append(f"{heading}:")
        out += [f"  {i}. {item}" if key == "check_questions" else f"  - {item}" for i, item in enumerate(value, 1)]
    out.append(f"\nrun it: minillm lesson {lesson.number}   (or python lessons/{lesson.path.name})")
    return "\n".join(out)


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
    from minillm.checkpoints.pull import resolve
    try:
        resolve(DEFAULT_LESSON_MODEL)
        return DEFAULT_LESSON_MODEL
    except MiniLLMError:
        return f"random:{DEFAULT_LESSON_MODEL}"


def lesson_model():
    """The model a lesson runs on ($MINILLM_LESSON_MODEL, default smollm2-135m); prints which it is."""
    import minillm
    from minillm.tools.bench import random_model
    from minillm.model.config import PRESETS
    from minillm.llm import LLM, thread_policy
    from minillm.threads import install

    spec = os.environ.get(MODEL_ENV) or DEFAULT_LESSON_MODEL
    if spec.startswith("random:"):
        preset = spec.split(":", 1)[1]
        if preset not in PRESETS:
            raise SystemExit(f"{MODEL_ENV}={spec}: unknown preset {preset!r} ({', '.join(PRESETS)})")
        cfg = PRESETS[preset].config
        print(f"model: random weights in the shape of {preset} (speeds are honest; texts are gibberish)")
        llm = LLM(cfg, random_model(cfg), StandInTokenizer(cfg.vocab_size), name=spec, chat_default=False)
        install(thread_policy(llm.model))           # BLAS threads measured, as minillm.load does (threads.py)
        return llm
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


def out_dir() -> Path:
    """The folder lessons write their plots into: lessons/out/, the student's, unless $MINILLM_LESSON_OUT
    names another (the test suite points it at a temporary folder: tests/conftest.py)."""
    return Path(os.environ.get(OUT_ENV) or LESSONS_DIR / "out")


def save_plot(filename: str, draw: Callable) -> Path | None:
    """Draw a figure with `draw(ax)` and write it to out_dir(); skip with a note without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"plot {filename} skipped: matplotlib is not installed ({install_hint('lessons')})")
        return None
    folder = out_dir()
    folder.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    draw(ax)
    fig.tight_layout()
    path = folder / filename
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
