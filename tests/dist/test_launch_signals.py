"""`bigtrain train` passes a stop to the ranks alone where DeepSpeed's per-node launcher runs here: signalled itself,
that launcher SIGKILLs its ranks 30 s later, inside bigtrain's 50 s grace, and a long step's save was cut short
without a word. A real process tree stands in for runner -> launcher -> rank; `bigtrain train` returns only once
the session is empty (a --resume at its return raced a rank still writing its checkpoint)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bigtrain.launch.signals import local_ranks, pass_signal, wait_for_session

RANK = """
import signal, sys, time
def stop(signum, frame):
    open(sys.argv[1], "w").write("stopped")
    time.sleep(0.5)  # a save
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
time.sleep(60)
"""
# the per-node launcher: ends when its rank does, as deepspeed.launcher.launch does; argv names it
LAUNCHER = "import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', sys.argv[2], sys.argv[3]]))"
RUNNER = "import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', *sys.argv[1:]]))"


def _tree(tmp_path: Path, runner: bool = True) -> subprocess.Popen:
    """runner -> launcher -> rank, or launcher -> rank as `bigtrain train` starts one machine's ranks."""
    launcher = [LAUNCHER, "deepspeed.launcher.launch", RANK, str(tmp_path / "rank")]
    runner = subprocess.Popen([sys.executable, "-c", *([RUNNER] if runner else []), *launcher], start_new_session=True)
    deadline = time.monotonic() + 30
    while len(local_ranks(runner.pid)) < 1:
        assert time.monotonic() < deadline and runner.poll() is None
        time.sleep(0.05)
    time.sleep(0.3)  # the rank's handler is installed
    return runner


@pytest.mark.parametrize("runner", [True, False], ids=["runner", "launcher_only"])
def test_the_ranks_alone_get_the_signal_and_the_launch_ends_with_them(tmp_path, runner):
    runner = _tree(tmp_path, runner)
    try:
        (rank,) = local_ranks(runner.pid)
        assert "-c" in rank.cmdline() and str(tmp_path / "rank") in rank.cmdline()
        pass_signal(runner.pid, signal.SIGTERM)
        assert runner.wait(timeout=30) == 0  # neither the runner nor the launcher died of it
        wait_for_session(runner.pid)
        assert (tmp_path / "rank").read_text() == "stopped"
    finally:
        _end(runner.pid)


def test_without_a_launcher_here_the_whole_session_gets_it(tmp_path):
    """Ranks on other nodes behind pdsh, or a stop before the ranks start: the session, as before."""
    lone = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    assert local_ranks(lone.pid) == []
    pass_signal(lone.pid, signal.SIGTERM)
    assert lone.wait(timeout=30) == -signal.SIGTERM


def test_bigtrain_train_waits_for_a_rank_its_launcher_left_behind(tmp_path):
    """A launcher gone while its rank still saves: the wait ends when the rank does, not when the launcher did."""
    runner = _tree(tmp_path)
    try:
        (rank,) = local_ranks(runner.pid)
        rank.send_signal(signal.SIGSTOP)  # a rank busy with its save
        os.kill(runner.pid, signal.SIGKILL)
        runner.wait(timeout=10)
        started = time.monotonic()
        subprocess.Popen(["sh", "-c", f"sleep 1; kill -CONT {rank.pid}; kill -TERM {rank.pid}"])
        wait_for_session(runner.pid)
        assert time.monotonic() - started >= 1 and not rank.is_running()
        assert (tmp_path / "rank").read_text() == "stopped"
    finally:
        _end(runner.pid)


def _end(session: int) -> None:
    try:
        os.killpg(session, signal.SIGKILL)
    except ProcessLookupError:
        pass
