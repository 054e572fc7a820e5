"""`bigtrain train`'s console: the launcher's line for a rank that ended with bigtrain's own stop is left out,
everything else passes through unchanged, progress-bar updates included (the journeys through a real launcher:
tests/dist/test_run_guard_journeys.py)."""
from __future__ import annotations

import io
import os

from bigtrain.launch.console import copy_filtered

STOP = (b"[2026-11-25 20:58:04,739] [ERROR] [launch.py:259:sigkill_handler] ['/venv/bin/python', '-u', '-m', "
        b"'bigtrain.run', '--local_rank=1'] exits with return code = 2\n")
CRASH = STOP.replace(b"return code = 2", b"return code = -11")


def through(*chunks: bytes) -> str:
    read, write = os.pipe()
    console = io.StringIO()
    thread = copy_filtered(os.fdopen(read, "rb"), console)
    with os.fdopen(write, "wb", buffering=0) as pipe:
        for chunk in chunks:
            pipe.write(chunk)
    thread.join(timeout=10)
    return console.getvalue()


def test_the_launchers_line_after_a_bigtrain_stop_is_left_out_and_the_rest_passes():
    said = b"bigtrain: --resume: no complete checkpoint in runs/x/checkpoints; drop --resume to start fresh\n"
    bar = b"\rtrain:  50%|#####     | 5/10 [00:01<00:01]\rtrain: 60%|######    | 6/10 [00:01<00:01]\n"
    out = through(b"[20:58:04 rank0] ranks: 0 pid 1 on vm\n", said[:20], said[20:], bar, STOP[:50], STOP[50:],
                  CRASH, b"\rtrain: 100%|##########| 10/10")
    assert out == ("[20:58:04 rank0] ranks: 0 pid 1 on vm\n" + said.decode() + bar.decode() + CRASH.decode()
                   + "\rtrain: 100%|##########| 10/10")


def test_the_launchers_line_after_a_signals_stop_is_left_out_and_a_rank_killed_by_one_keeps_it():
    """A SIGTERM before the first step: the rank says so in one line and exits 143; the launcher's "exits with return
    code = 143" repeated every argument after it. A rank the signal killed outright (-15) said nothing: its line
    stays."""
    stopped = STOP.replace(b"return code = 2", b"return code = 143")
    interrupted = STOP.replace(b"return code = 2", b"return code = 130")
    killed = STOP.replace(b"return code = 2", b"return code = -15")
    assert through(stopped, interrupted, killed) == killed.decode()
