"""A rank's lifeline: it stops when asked, and it never waits forever.

Python runs a signal handler only when the main thread is between bytecodes, so a rank blocked
inside a collective (its peer stuck elsewhere) never sees SIGTERM, and a finished job could sit
in a barrier until the cluster's wall time ran out. A `Lifeline` thread sees what the main thread
cannot:

- SIGTERM / SIGINT, through `signal.set_wakeup_fd` (written by the C-level handler even while
  the main thread waits): the stop flag is set, the loop saves at the next step boundary, and a
  rank that has not exited `grace_s` later (default 50 s) ends with a line naming what it was
  doing. A second SIGINT ends it at once.
- the launcher's death: a rank started by `deepspeed` or `torchrun` watches its launcher
  processes and stops the same way when they are gone, so killing the launcher ends its ranks.
- a bounded step (`bound(phase, seconds)`): when the end-of-run steps (final checkpoint,
  summary, sample, last barrier) do not finish in time, the job ends with a line naming the
  step and what it waited for.
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

DEFAULT_GRACE_S = 50.0
AGENTS = ("deepspeed.launcher.launch", "torch.distributed.run", "torchrun")  # a rank's direct parent


@dataclass(frozen=True)
class Ancestor:
    pid: int
    started: float
    what: str

    def alive(self) -> bool:
        return process_alive(self.pid, self.started)


def process_alive(pid: int, started: float) -> bool:
    """Whether the process `pid` that started at `started` still runs: a recycled pid is another process, and a
    zombie (killed, not yet reaped) is gone."""
    import psutil
    try:
        proc = psutil.Process(pid)
        return proc.create_time() == started and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def stop_grace_s() -> float:
    """How long a rank may take to save and exit after a stop request (BIGTRAIN_STOP_GRACE_S, default 50 s)."""
    return float(os.environ.get("BIGTRAIN_STOP_GRACE_S", DEFAULT_GRACE_S))


class Lifeline:
    """One per rank, for the whole job: `requested`/`reason` for the loop, `bound` for steps that must end."""

    def __init__(self, rank: int, grace_s: float | None = None, interval: float = 0.5):
        self.rank = rank
        self.grace_s = grace_s if grace_s is not None else stop_grace_s()
        self.interval = interval
        self.requested = False
        self.reason = ""  # "SIGTERM", "SIGINT", "the launcher ... is gone"
        self.phase = "start-up"
        self._requested_at: float | None = None
        self._signum = 0
        self._deadline: tuple[float, str] | None = None  # (monotonic time, what the bounded step waits for)
        self._stop = threading.Event()
        self._reader: socket.socket | None = None
        self._restore: list = []
        self.ancestors: list[Ancestor] = []
        # Called before a signal's stop is announced: the peer watch ends the rank there, naming a dead peer, when
        # the signal is the launcher ending the survivors of a rank it saw die (its poll can beat the watch's).
        self.before_stop: Callable[[], None] | None = None
        self._thread = threading.Thread(target=self._run, name="bigtrain-lifeline", daemon=True)

    @classmethod
    def start(cls, rank: int, grace_s: float | None = None) -> "Lifeline":
        """Install the signal handlers (main thread only: Ray runs jobs in threads) and start watching."""
        line = cls(rank, grace_s)
        if threading.current_thread() is threading.main_thread():
            line._install_signals()
        line.ancestors = launcher_ancestors()
        line._thread.start()
        return line

    def close(self) -> None:
        """Stop watching and give the previous signal handlers back (a test process runs several jobs)."""
        self._stop.set()
        for restore in reversed(self._restore):
            restore()
        self._restore.clear()

    def set_phase(self, phase: str) -> None:
        self.phase = phase

    @contextlib.contextmanager
    def bound(self, phase: str, seconds: float, waits_for: str) -> Iterator[None]:
        """End the job with a line naming `phase` and `waits_for` when the block runs over `seconds`."""
        previous, self.phase = self.phase, phase
        self._deadline = (time.monotonic() + seconds, f"{phase} did not finish within {_seconds(seconds)} s "
                                                      f"(waiting for {waits_for})")
        try:
            yield
        finally:
            self._deadline = None
            self.phase = previous

    def request(self, reason: str, signum: int = 0) -> None:
        """Ask this rank to stop (what a signal or the launcher's death does)."""
        if _ending_code:  # the job is already ending on purpose: this is the launcher ending the ranks left
            sys.stdout.flush()
            os._exit(_ending_code[0])
        if self.requested:
            if signum == signal.SIGINT and self._signum == signal.SIGINT:
                self._end(f"second SIGINT during {self.phase}: stopping now", 130)
            return
        if signum and self.before_stop is not None:
            self.before_stop()
        if signum and self.phase == "start-up":  # no step yet: waiting for one only to save nothing would let the
            # grace run out inside a long start-up (a reference precompute), and the line would then say --resume
            self._end(f"{reason} during start-up, before the first step: nothing was trained, so nothing is saved",
                      128 + signum, advice="Run the same command again to start where this one started.",
                      say=self.rank == 0)
        self.requested, self.reason, self._signum = True, reason, signum
        self._requested_at = time.monotonic()
        if self.rank == 0 or not signum:
            print(f"bigtrain: rank {self.rank}: {reason}: saving a checkpoint at the end of this step, then "
                  f"exiting (at most {self.grace_s:.0f} s)", file=sys.stderr, flush=True)

    # -- the watching thread --------------------------------------------------------------------

    def _install_signals(self) -> None:
        reader, writer = socket.socketpair()
        reader.setblocking(False)
        writer.setblocking(False)
        previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._reader = reader
        self._restore.append(lambda: (signal.set_wakeup_fd(previous_fd), reader.close(), writer.close()))
        for sig in (signal.SIGTERM, signal.SIGINT):
            old = signal.signal(sig, self._python_handler)
            self._restore.append(lambda s=sig, h=old: signal.signal(s, h))

    def _python_handler(self, signum: int, frame: object) -> None:
        """Replaces Python's KeyboardInterrupt and does nothing more: the watching thread reads every signal from
        the wakeup fd, so one signal is one request (asked here too, one Ctrl-C read as a second SIGINT and
        stopped the rank without its checkpoint)."""

    def _run(self) -> None:
        while not self._stop.is_set():
            self._read_signals(self.interval)
            if not self.requested:
                gone = [a for a in self.ancestors if not a.alive()]
                self._read_signals(0.0)  # a signal sent with the launcher's (killpg) is named as such
                if gone and not self.requested:
                    self.request(f"the launcher ({gone[0].what}, pid {gone[0].pid}) is gone")
            self._check_deadlines()

    def _read_signals(self, timeout: float) -> None:
        if self._reader is None:
            self._stop.wait(timeout)
            return
        try:
            ready, _, _ = select.select([self._reader], [], [], timeout)
            data = self._reader.recv(64) if ready else b""
        except (OSError, ValueError):  # closed by close()
            self._reader = None
            return
        for signum in data:
            if signum in (signal.SIGTERM, signal.SIGINT):
                self.request(signal.Signals(signum).name, signum)

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        if self.requested and self._requested_at is not None and now - self._requested_at > self.grace_s:
            self._end(f"{self.reason} {self.grace_s:.0f} s ago, and {self.phase} has not finished (a peer that "
                      "does not answer?): exiting without a new checkpoint", 128 + (self._signum or 15))
        deadline = self._deadline
        if deadline is not None and now > deadline[0]:
            self._end(deadline[1], 1)

    def _end(self, line: str, code: int, advice: str = "Resume from the last complete checkpoint with --resume.",
             say: bool = True) -> None:
        if say:
            print(f"bigtrain: rank {self.rank}: {line}. {advice}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(code)


_ending_code: list[int] = []


def ending_on_purpose(code: int) -> None:
    """The job stops on purpose with exit `code` (`JobStop.end`) and this rank has said what it had to say.
    The launcher ends every rank once one exits: a SIGTERM (or a launcher gone) from now on ends this rank quietly
    with `code`, instead of asking it to save a checkpoint."""
    _ending_code[:] = [code]


def launcher_ancestors() -> list[Ancestor]:
    """The launcher processes of this rank: deepspeed's per-node launch and, above it, the `deepspeed`
    runner (or pdsh's remote shell), or torchrun's agent. Only a rank whose parent is one of these
    watches anything: a plain `python` run, or a parent bigtrain does not know, is left alone."""
    if os.environ.get("BIGTRAIN_WATCH_LAUNCHER", "1") == "0":
        return []
    import psutil
    found = []
    try:
        parents = psutil.Process().parents()[:2]
        if not parents or not any(name in " ".join(parents[0].cmdline()) for name in AGENTS):
            return []
        for proc in parents:
            cmdline = " ".join(proc.cmdline())
            if "deepspeed" not in cmdline and not any(name in cmdline for name in AGENTS):
                break
            found.append(Ancestor(proc.pid, proc.create_time(), _describe(cmdline)))
            if "deepspeed.launcher.launch" not in cmdline:
                break  # the runner (or torchrun): what started it is the user's, not the job's
    except psutil.Error:
        return found
    return found


def _describe(cmdline: str) -> str:
    if "deepspeed.launcher.launch" in cmdline:
        return "deepspeed's per-node launch"
    if "torch" in cmdline:
        return "torchrun"
    return "the deepspeed runner"


def _seconds(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.2g}"
