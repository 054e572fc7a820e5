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
line.set_phase("training step 3")
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


IN_START_UP = """
import os, signal, sys, time
sys.path.insert(0, {repo!r})
from bigtrain.distributed.lifeline import Lifeline
line = Lifeline.start(0, grace_s=30)
os.kill(os.getpid(), signal.SIGTERM)  # a start-up as long as a reference precompute
time.sleep(20)
print("not reached", flush=True)
"""


def test_a_sigterm_before_the_first_step_ends_at_once_without_advising_resume():
    """A SIGTERM during a long start-up (11 s of reference log-probs) waited for the grace, then said "Resume from
    the last complete checkpoint with --resume", where there was none and --resume failed: nothing is trained yet,
    so the rank ends at once and says to run the same command again."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", IN_START_UP.format(repo=str(REPO))], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 143 and time.monotonic() - start < 15 and "not reached" not in proc.stdout
    assert naming(proc.stderr, "rank 0", "SIGTERM during start-up", "nothing is saved", "same command"), proc.stderr
    assert "--resume" not in proc.stderr, proc.stderr


LAUNCHER_ENDS_THE_SURVIVOR = """
import os, signal, socket, subprocess, sys, time
import psutil
sys.path.insert(0, {repo!r})
from bigtrain.distributed.job_stop import JobStop
from bigtrain.distributed.lifeline import Lifeline
from bigtrain.distributed.peer_watch import PeerWatch
from bigtrain.distributed.peers import Peer, PeerStore
from bigtrain.distributed.world import World
peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
host = socket.gethostname()
peers = [Peer(0, host, os.getpid(), psutil.Process().create_time()),
         Peer(1, host, peer.pid, psutil.Process(peer.pid).create_time())]
world, store = World(0, 0, 2), PeerStore(None)
line = Lifeline.start(0)
watch = PeerWatch.start(world, peers, store, JobStop(world, peers, store), interval=60.0)  # too slow to see it
line.before_stop = watch.end_if_a_peer_is_lost
peer.kill()
peer.wait()
os.kill(os.getpid(), signal.SIGTERM)  # the launcher, which saw rank 1 die, ends rank 0
time.sleep(10)
print("not reached", flush=True)
"""


def test_a_survivor_the_launcher_ends_names_the_dead_peer_not_the_signal():
    """DeepSpeed's launcher polls its ranks once a second and SIGTERMs the others when one dies; the peer watch
    looks once a second too. When the launcher won, the survivor's first line was 'SIGTERM: saving a checkpoint'
    (tests/dist/test_failures.py failed one run in a few under load): a signal is now announced only after the
    watch has looked for a dead peer, so the one line names the dead rank whichever was first."""
    proc = subprocess.run([sys.executable, "-c", LAUNCHER_ENDS_THE_SURVIVOR.format(repo=str(REPO))],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "not reached" not in proc.stdout, proc.stdout + proc.stderr
    lines = [text for text in proc.stderr.splitlines() if text.startswith("bigtrain: ")]
    assert len(lines) == 1 and naming(lines[0], "rank 1 (pid", "gone", "rank 0", "stops too", "--resume"), lines
    assert "SIGTERM" not in proc.stderr, proc.stderr
