"""A rank's lifeline without ranks: an end-of-run step that waits too long for its peers ends the job with
one line (a stop request inside a collective and a launcher that is gone: tests/dist/test_journey.py)."""
from __future__ import annotations

import subprocess
import sys
import time

from launch import REPO
from messages import naming

BOUNDED = """
import sys, time
sys.path.insert(0, {repo!r})
from bigtrain.distributed.lifeline import Lifeline
line = Lifeline.start(1)
with line.bound("the end-of-run sample", 0.5, "every rank to run the sample's forward passes"):
    time.sleep(30)  # a peer that never joins
print("not reached", flush=True)
"""


def test_an_end_of_run_step_that_waits_too_long_ends_the_job_with_a_line():
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", BOUNDED.format(repo=str(REPO))], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1 and time.monotonic() - start < 10 and "not reached" not in proc.stdout
    # one line from the rank: the step, its bound, what it waited for, and the way on
    assert proc.stderr.startswith("bigtrain: rank 1: "), proc.stderr
    assert naming(proc.stderr, "end-of-run sample", "0.5 s", "every rank to run the sample's forward passes",
                  "Resume from"), proc.stderr


ONE_CTRL_C = """
import os, signal, sys, time
sys.path.insert(0, {repo!r})
from bigtrain.distributed.lifeline import Lifeline
line = Lifeline.start(0)
os.kill(os.getpid(), signal.SIGINT)  # one Ctrl-C: both the wakeup fd (the watching thread) and the handler see it
for _ in range(20):  # a training step's worth of Python, where the handler runs
    time.sleep(0.05)
print("stop requested:", line.requested, line.reason, flush=True)
os.kill(os.getpid(), signal.SIGINT)  # a second one ends the rank at once
time.sleep(5)
print("not reached", flush=True)
"""


def test_one_ctrl_c_asks_for_a_checkpoint_and_a_second_ends_the_rank():
    """A terminal's Ctrl-C is one SIGINT: the rank saves at the next step boundary. It was seen twice (by the
    watching thread through the wakeup fd and by the Python handler) and read as a second SIGINT, which stops
    at once without a checkpoint (a `bigtrain train` stopped with Ctrl-C lost every step since its last save)."""
    proc = subprocess.run([sys.executable, "-c", ONE_CTRL_C.format(repo=str(REPO))], capture_output=True, text=True,
                          timeout=60)
    assert "stop requested: True SIGINT" in proc.stdout, proc.stdout + proc.stderr
    assert naming(proc.stderr, "rank 0", "SIGINT", "saving a checkpoint"), proc.stderr
    assert proc.returncode == 130 and "not reached" not in proc.stdout
    assert naming(proc.stderr, "second SIGINT", "stopping now"), proc.stderr
