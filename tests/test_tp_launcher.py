"""The tensor-parallel launcher without MPI: a rank's error line reaches the user even when its abort ends
mpiexec before mpiexec forwarded the rank's stderr, and a stop that mpiexec ignores ends in a kill
(test_tensor_parallel_mpi runs the launcher for real)."""
from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from minillm.engine.parallel import launcher


class FakeComm:
    size, rank = 3, 1

    def __init__(self):
        self.aborted = None

    def abort(self, code):
        self.aborted = code


@pytest.fixture
def rank(monkeypatch):
    comm = FakeComm()
    monkeypatch.setattr(launcher, "_active", comm)
    return comm


def test_each_rank_appends_its_error_line_before_aborting(rank, tmp_path, monkeypatch):
    errors = tmp_path / "errors"
    monkeypatch.setenv(launcher.ERRORS_VAR, str(errors))
    launcher.exit_rank(1, "minillm: error: tp=3 does not divide 8 heads")
    launcher.exit_rank(1, "minillm: error: tp=3 does not divide 8 heads\n")     # another rank, same line
    assert rank.aborted == 1
    assert errors.read_text() == "minillm: error: tp=3 does not divide 8 heads\n" * 2


def test_the_launcher_shows_the_reported_lines_once_each(tmp_path, capsys):
    errors = tmp_path / "errors"
    errors.write_text("minillm: error: A\nnoise\nminillm: error: A\nminillm: error: B\n")
    assert launcher._show_reported_errors(str(errors)) is True
    assert capsys.readouterr().err == "minillm: error: A\nminillm: error: B\n"
    assert launcher._show_reported_errors(str(tmp_path / "none")) is False      # no rank reported: the generic line


def test_outside_a_launch_nothing_is_written(rank, tmp_path, monkeypatch):
    monkeypatch.delenv(launcher.ERRORS_VAR, raising=False)
    launcher.exit_rank(1, "minillm: error: x")
    assert rank.aborted == 1 and not list(tmp_path.iterdir())


def test_ranks_that_ignore_the_stop_signal_are_killed_after_the_grace(monkeypatch):
    """`_stop` passes SIGTERM on to mpiexec; one that has not ended STOP_GRACE_S later is killed (its hydra
    proxies then kill the ranks), so a stuck rank cannot keep the launcher, or itself, alive."""
    monkeypatch.setattr(launcher, "STOP_GRACE_S", 0.5)
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                                 "signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert stubborn.stdout.readline() == "ready\n"
        assert launcher._stop(stubborn, signal.SIGTERM) == 128 + signal.SIGKILL
        assert stubborn.poll() == -signal.SIGKILL
    finally:
        stubborn.kill()
        stubborn.wait()
