"""Where minillm's shipped folders live (kernels/, lessons/), how to install what it lacks, and the current
measured figures.

In a source checkout (or an editable install of one) they are the checkout's top-level folders, where
the README puts them. A built wheel carries copies inside the package, as minillm/kernels and
minillm/lessons (setup.py's build step copies them), so an installed minillm reads those.

The current figures (lessons/BENCHMARKS.md's first table) ship as package data, data/current_figures.json,
so a lesson can print the reference beside what it measured on the student's machine.
"""
from __future__ import annotations

import json
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
CHECKOUT_DIR = PACKAGE_DIR.parent           # the repository root, when this is a source checkout
# The name pip knows minillm by (setup.cfg's `name`): `minillm` on PyPI is an unrelated project, so a
# hint naming `minillm` with an extra would install someone else's code. The import name and the
# command stay `minillm`.
DISTRIBUTION = "minillm-engine"
FIGURES_FILE = PACKAGE_DIR / "data" / "current_figures.json"


def is_checkout() -> bool:
    """Whether this minillm runs from a source checkout (plainly or as an editable install of one)."""
    return (CHECKOUT_DIR / "setup.cfg").is_file() and (CHECKOUT_DIR / "minillm").is_dir()


def data_dir(name: str) -> Path:
    """The shipped folder `name` ("kernels" or "lessons"): the checkout's, else the installed copy."""
    checkout = CHECKOUT_DIR / name
    if is_checkout() and checkout.is_dir():
        return checkout
    return PACKAGE_DIR / name


def install_hint(extra: str) -> str:
    """The pip command that adds the optional dependencies `extra` (setup.cfg's extras_require: gpu,
    serve, lessons, tp, formats, test) to this minillm. From a checkout it reinstalls the checkout
    (`.` when the shell is in it, else its path); from a wheel it names the distribution, not `minillm`.
    Double quotes: the brackets need quoting in zsh, and cmd.exe knows no single quotes."""
    if is_checkout():
        return f'pip install -e "{"." if _cwd() == CHECKOUT_DIR else CHECKOUT_DIR}[{extra}]"'
    return f'pip install "{DISTRIBUTION}[{extra}]"'


def current_figures() -> list[dict]:
    """The current figures, one dict a row of BENCHMARKS.md's first table: key, figure, unit, machine, date,
    section, and values ({engine: number} for the engines measured on that row)."""
    return json.loads(FIGURES_FILE.read_text(encoding="utf-8"))["figures"]


def figure(key: str) -> dict:
    """The current figure `key` (e.g. "gpu.decode.mistral-7b.fp16"); KeyError when the table has none."""
    found = next((f for f in current_figures() if f["key"] == key), None)
    if found is None:
        raise KeyError(f"no current figure {key!r} in lessons/BENCHMARKS.md's table")
    return found


def reference(key: str, engine: str = "minillm") -> str:
    """One line for a lesson to print beside its own measurement, e.g. 'reference: 23.4 tok/s on 2 cores,
    Intel Xeon VM (busy), 2026-12-06 (decode, SmolLM2-135M-Instruct, ...; lessons/BENCHMARKS.md)'."""
    row = figure(key)
    who = "" if engine == "minillm" else f"{engine}, "
    return (f"reference: {row['values'][engine]:,} {row['unit']} on {row['machine']}, {row['date']} "
            f"({who}{row['figure']}; lessons/BENCHMARKS.md)")


def import_root() -> Path:
    """The folder that holds the `minillm` package: what a subprocess needs on its PYTHONPATH."""
    return CHECKOUT_DIR


def _cwd() -> Path | None:
    try:
        return Path.cwd().resolve()
    except OSError:                 # the shell's folder was deleted under it
        return None
