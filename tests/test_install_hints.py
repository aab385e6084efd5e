"""Every "pip install" hint minillm prints installs minillm (issue 16): `minillm` on PyPI is an unrelated
project, so the distribution is `minillm-engine` and a hint names it, or, from a source checkout,
reinstalls the checkout with the extra. The wheel's side is in tests/test_install.py."""
from __future__ import annotations

import configparser
import re
from pathlib import Path

from click.testing import CliRunner

import minillm
from minillm import resources
from minillm.resources import DISTRIBUTION, install_hint

ROOT = Path(__file__).resolve().parents[1]


def _setup_cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return cfg


def _sources() -> list[Path]:
    """What a user reads or runs: the package, the lessons, the docs."""
    return [*(ROOT / "minillm").rglob("*.py"), *(ROOT / "lessons").rglob("*.py"), *ROOT.glob("*.md"),
            *(ROOT / "lessons").glob("*.md"), *(ROOT / "minillm").rglob("*.sh")]


def test_the_distribution_is_not_pypis_minillm():
    assert _setup_cfg()["metadata"]["name"] == DISTRIBUTION == "minillm-engine"


def test_from_a_checkout_the_hint_reinstalls_the_checkout(monkeypatch, tmp_path):
    assert resources.is_checkout()            # these tests run from the repository
    monkeypatch.chdir(ROOT)
    assert install_hint("gpu") == 'pip install -e ".[gpu]"'
    monkeypatch.chdir(tmp_path)               # elsewhere "." is some other folder: name the checkout
    assert install_hint("serve") == f'pip install -e "{ROOT}[serve]"'


def test_from_an_installed_package_the_hint_names_the_distribution(monkeypatch, tmp_path):
    site = tmp_path / "site-packages"         # a wheel's install: no setup.cfg beside the package
    (site / "minillm").mkdir(parents=True)
    monkeypatch.setattr(resources, "CHECKOUT_DIR", site)
    monkeypatch.chdir(site)
    assert not resources.is_checkout()
    assert install_hint("tp") == 'pip install "minillm-engine[tp]"'


def test_no_hint_installs_pypis_minillm():
    """`pip install minillm`, `pip install 'minillm[gpu]'`, "needs minillm[serve]": each would fetch
    someone else's code. Hints come from install_hint; the README says -e ".[extra]" or minillm-engine."""
    wrong = re.compile(r"""pip3? install (-U |--upgrade )?["']?minillm\b(?!-engine)|\bminillm\[""")
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in _sources()
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if wrong.search(line)]
    assert found == []


def test_every_hinted_extra_exists():
    extras = set(_setup_cfg()["options.extras_require"])
    named = {m for p in _sources() if p.suffix == ".py"
             for m in re.findall(r"install_hint\(['\"](\w+)['\"]\)", p.read_text(encoding="utf-8"))}
    assert {"gpu", "serve", "lessons", "tp", "formats", "test"} <= named     # the sweep sees the call sites
    assert named <= extras, named - extras


def test_version_does_not_need_installed_metadata():
    """click's default looks the version up by distribution name; a bare checkout (PYTHONPATH) has none,
    and after the rename `minillm` would name another project's metadata."""
    from minillm.cli import cli
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"minillm, version {minillm.__version__}"


def test_the_readme_shows_both_ways_to_install_an_extra():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert 'pip install -e ".[gpu]"' in readme and 'pip install "minillm-engine[gpu]"' in readme
