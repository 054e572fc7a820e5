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
