"""A built wheel works without the checkout (issue 16): it carries kernels/ and lessons/, so an installed
minillm lists and runs a lesson and finds every CUDA source; without the lessons it says so in one line.

The wheel is built once for the module, from a copy of the checkout's files (so the build leaves no
build/ or egg-info behind), and installed with pip into a fresh venv that sees this interpreter's
packages through a .pth path entry, not its site folder, so the checkout's editable install stays out."""
from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["minillm", "kernels", "lessons", "setup.cfg", "setup.py", "pyproject.toml", "MANIFEST.in", "README.md"]
SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", "out", ".pytest_cache")


def _run(*cmd, env=None, check=True):
    # cwd: not the checkout, whose minillm/ `python -c` would import first
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, timeout=300,
                            cwd=Path(__file__).anchor)
    if check:
        assert result.returncode == 0, f"{cmd}: {result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """-> the bin/ folder of a fresh venv with only the built wheel of minillm installed."""
    work = tmp_path_factory.mktemp("install")
    src = work / "src"
    src.mkdir()
    for name in SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, src / name, ignore=SKIP)
        else:
            shutil.copy(source, src / name)
    _run(sys.executable, "-m", "pip", "--disable-pip-version-check", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", work / "dist", src)
    wheel = next((work / "dist").glob("minillm_engine-*.whl"))      # the distribution name (issue 16)
    _run(sys.executable, "-m", "venv", "--without-pip", work / "venv")
    bin_dir = work / "venv" / "bin"
    venv_site = Path(_run(bin_dir / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
                     .stdout.strip())
    # dependencies (NumPy, click, ...) from this interpreter, as plain path entries: its .pth files,
    # the editable install's finder among them, are not run
    (venv_site / "zz_host_packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run(sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", bin_dir / "python", "install", "--no-deps", "--no-index", "-q", wheel)
    return bin_dir


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "MINILLM_"))}
    return env | {"MINILLM_LESSON_QUICK": "1", "OPENBLAS_NUM_THREADS": "1"}


INSPECT = """
import json, minillm
from importlib.metadata import distribution
from minillm.resources import install_hint
from minillm.course.lessons import LESSONS_DIR
from minillm.cuda.kernels import KERNEL_DIR, SOURCES, kernel_source
from minillm.cuda.dev.lab import LAB_KERNEL_DIR, lab_source
sources = {name: len(kernel_source(name)) for name in SOURCES}     # each .cu with its #includes pasted in
lab = {p.stem: len(lab_source(p.stem)) for p in LAB_KERNEL_DIR.glob("*.cu")}
print(json.dumps({"package": minillm.__file__, "kernels": str(KERNEL_DIR), "lessons": str(LESSONS_DIR),
                  "sources": sources, "lab": str(LAB_KERNEL_DIR), "lab_sources": lab, "hint": install_hint("gpu"), "dist": distribution("minillm-engine").metadata["Name"],
                  "scripts": [e.value for e in distribution("minillm-engine").entry_points]}))
"""


@pytest.fixture(scope="module")
def installed(venv):
    """Where the installed minillm finds itself, its kernels and its lessons (one interpreter start)."""
    import json
    return json.loads(_run(venv / "python", "-c", INSPECT, env=_env()).stdout)


def test_the_installed_package_is_the_wheel(venv, installed):
    assert installed["package"].startswith(str(venv.parent)), installed
    for folder in ("kernels", "lessons"):
        assert Path(installed[folder]) == Path(installed["package"]).parent / folder


def test_the_wheel_carries_the_exercise_stubs_but_not_their_solutions(installed):
    exercises = Path(installed["lessons"]) / "exercises"
    assert sorted(p.name for p in exercises.glob("ex*.py")) == sorted(p.name for p in (ROOT / "lessons/exercises").glob("ex*.py"))
    assert not (exercises / "solutions").exists()


def test_every_kernel_source_is_installed_and_assembles(installed):
    """The CPU half of the kernel compile check (tests/test_kernels_compile.py): every source the GPU path
    loads is in the installed package and its #includes resolve; where nvcc is on PATH, one compiles."""
    kernel_dir = Path(installed["kernels"])
    assert sorted(p.name for p in kernel_dir.iterdir()) == sorted(p.name for p in (ROOT / "kernels").iterdir())
    assert all(n > 0 for n in installed["sources"].values())
    if shutil.which("nvcc"):
        _run("nvcc", "-arch=sm_90", "-std=c++17", "-c", kernel_dir / "rmsnorm.cu", "-o", kernel_dir.parent / "k.o")


def test_the_labs_kernels_are_installed_and_assemble(installed):
    """The earlier versions the lessons show (minillm/cuda/dev/kernels, package data) are in the wheel, and their
    #includes of the shipped headers resolve there."""
    lab = Path(installed["lab"])
    assert lab == Path(installed["package"]).parent / "cuda" / "dev" / "kernels"
    assert sorted(p.name for p in lab.iterdir()) == sorted(p.name for p in (ROOT / "minillm/cuda/dev/kernels").iterdir())
    assert installed["lab_sources"] and all(n > 0 for n in installed["lab_sources"].values())


def test_a_lesson_runs_from_the_installed_wheel(venv):
    listing = _run(venv / "minillm", "lesson", env=_env()).stdout
    assert "01  " in listing and "forward" in listing
    result = _run(venv / "minillm", "lesson", "1", "--quick", "--model", "random:smollm2-135m", env=_env())
    assert "Traceback" not in result.stderr


def test_without_the_lessons_minillm_lesson_says_so_in_one_line(venv, installed):
    lessons = Path(installed["lessons"])
    hidden = lessons.with_name("lessons-hidden")
    lessons.rename(hidden)
    try:
        result = _run(venv / "minillm", "lesson", "1", env=_env(), check=False)
    finally:
        hidden.rename(lessons)
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1, lines
    assert lines[0].startswith("minillm: error:") and "lessons are not installed" in lines[0], lines[0]


def test_a_checkout_reads_its_own_folders():
    from minillm.resources import data_dir
    assert data_dir("kernels") == ROOT / "kernels" and data_dir("lessons") == ROOT / "lessons"


def test_the_installed_distribution_is_minillm_engine_and_its_hints_say_so(venv, installed):
    """Installed from a wheel, minillm is the distribution minillm-engine, the command is still
    `minillm`, and a hint names minillm-engine (PyPI's `minillm` is another project)."""
    assert installed["dist"] == "minillm-engine" and installed["scripts"] == ["minillm.cli:main"]
    assert installed["hint"] == 'pip install "minillm-engine[gpu]"'
    version = _run(venv / "minillm", "--version", env=_env()).stdout.strip()
    assert version == "minillm, version 0.1.0"
