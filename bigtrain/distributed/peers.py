"""The peers of a job, and ending it with one clear line when one of them is gone or stops on a user's mistake."""
from __future__ import annotations

import os
import re
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, NoReturn

import torch

from bigtrain.distributed.lifeline import ending_on_purpose
from bigtrain.distributed.world import World


# --- Peers: who is in the job, and ending it with a clear line when one of them is gone ------------

@dataclass(frozen=True)
class Peer:
    rank: int
    host: str
    pid: int
    started: float  # process start time: a recycled pid is not taken for the peer

    def __str__(self) -> str:
        return f"rank {self.rank} (pid {self.pid} on {self.host})"


def gather_peers(world: World) -> list[Peer]:
    """Every rank's host and pid, in rank order (a collective)."""
    import psutil
    me = Peer(world.rank, socket.gethostname(), os.getpid(), psutil.Process().create_time())
    if not torch.distributed.is_initialized() or world.size == 1:
        return [me]
    peers: list = [None] * world.size
    torch.distributed.all_gather_object(peers, me)
    return peers


def peer_alive(peer: Peer) -> bool:
    """Whether `peer`'s process (on this host) still runs; a zombie (killed, not yet reaped) is gone."""
    import psutil
    try:
        proc = psutil.Process(peer.pid)
        return proc.create_time() == peer.started and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class PeerWatch:
    """Ends this rank with a line naming the culprit when a peer process is gone.

    A SIGKILLed rank says nothing, and the others either fail with gloo's "Connection reset by
    peer", which names no rank, or wait in an NCCL collective until the timeout; DeepSpeed's
    launcher then prints the command line of its *last* rank, whichever rank died. So a daemon
    thread checks the peers on this host by pid every `interval` seconds, posts what it finds
    in the rendezvous store for the ranks on other hosts, and exits the process. `fail()` is the
    main thread's side: after an exception it names the dead peer if there is one, else this rank.
    Ranks leaving in good order call `leave()` first, so a finished peer is not taken for a dead one.

    A job that stops on purpose (a user's mistake, a diverging loss, a full disk), seen by one rank or
    by all, goes through `stop_job()`: the first rank to stop posts its message, rank 0 prints it, and
    every other rank leaves without a word. Rank 0 (whose process holds the rendezvous store under the
    deepspeed launcher) leaves last, so no peer's store call fails with torch's C++ stack trace, and no
    peer takes rank 0's exit for a crash.
    """

    LOST, LEFT, BEAT = "bigtrain/lost", "bigtrain/left/", "bigtrain/beat/"
    STOPPED, PRINTED = "bigtrain/stopped", "bigtrain/stopped-printed"
    FOLLOW_GRACE_S = 5.0

    def __init__(self, world: World, peers: list[Peer], store: Any, interval: float = 1.0):
        self.world, self.peers, self.store, self.interval = world, peers, store, interval
        me = peers[world.rank]
        # Only peers visible now are watched: a pid namespace of its own must not look like a death.
        self.local = [p for p in peers if p.host == me.host and p.rank != world.rank and peer_alive(p)]
        self._stop = threading.Event()
        self._ending = threading.Lock()
        self._stopping = False  # this rank is ending for a stop (stop_job or the watch thread following one)
        self._main_stopping = threading.Event()  # the main thread called stop_job
        self._thread = threading.Thread(target=self._run, name="bigtrain-peer-watch", daemon=True)

    @classmethod
    def start(cls, world: World, interval: float = 1.0) -> "PeerWatch":
        """Gather the peers (a collective) and start watching them; BIGTRAIN_PEER_WATCH=0 turns it off."""
        peers = gather_peers(world)
        store = torch.distributed.distributed_c10d._get_default_store() if world.size > 1 else None
        watch = cls(world, peers, store, interval)
        if world.size > 1 and os.environ.get("BIGTRAIN_PEER_WATCH", "1") != "0":
            watch._thread.start()
        return watch

    def describe(self, limit: int = 16) -> str:
        shown = ", ".join(f"{p.rank} pid {p.pid} on {p.host}" for p in self.peers[:limit])
        return "ranks: " + shown + (f" ... ({len(self.peers)} in all)" if len(self.peers) > limit else "")

    def leave(self) -> None:
        """Stop watching and tell the peers this rank is leaving in good order."""
        self._stop.set()
        self._store_call(lambda s: s.set(self.LEFT + str(self.world.rank), "1"))

    def stop_job(self, message: str, code: int) -> int:
        """End the job on purpose: rank 0 prints `message` (or the one a peer posted first) as `bigtrain:` lines,
        the other ranks say nothing; returns the exit code, once every peer has left (bounded)."""
        self._main_stopping.set()
        with self._ending:
            taken = self._stopping
            self._stopping = True
            self._stop.set()
        if taken:  # the watch thread is already ending this rank for a peer's stop: it exits the process
            time.sleep(60.0)
            return code
        if self.store is None:  # a world of one (or the store is gone): this rank speaks for itself
            if self.world.is_main:
                _print_lines(message)
            return code
        self._store_call(lambda s: s.compare_set(self.STOPPED, "", f"{code}\n{message}"))
        return self._leave_stopped(code)

    def _follow_stop(self) -> None:
        """The watch thread's side of `stop_job`: a peer stopped the job, so this rank leaves too, unless its main
        thread gets there itself within a few seconds (a stop every rank sees alike: the main thread may be
        writing the summary)."""
        if self._main_stopping.wait(self.FOLLOW_GRACE_S):
            return
        with self._ending:
            if self._stopping:
                return
            self._stopping = True
        code = self._leave_stopped(1)
        sys.stdout.flush()
        os._exit(code)

    def _leave_stopped(self, code: int) -> int:
        posted = self._store_call(lambda s: s.get(self.STOPPED).decode()) or f"{code}\n"
        posted_code, _, message = posted.partition("\n")
        code = int(posted_code) if posted_code.isdigit() else code
        self._store_call(lambda s: s.set(self.LEFT + str(self.world.rank), "1"))
        if self.world.is_main:
            _print_lines(message)
        ending_on_purpose(code)
        if self.world.is_main:
            self._store_call(lambda s: s.set(self.PRINTED, "1"))
            # a peer's watch thread follows a stop within FOLLOW_GRACE_S and its interval, even from inside a collective
            self._wait_for(lambda: all(self._left(p) for p in self.peers if p.rank != 0),
                           seconds=3 * self.FOLLOW_GRACE_S + 3 * self.interval)
            time.sleep(0.2)  # the peers' last store reads return before the store goes
        else:  # leave once rank 0 has printed: a launcher ends every rank when the first one exits
            self._wait_for(lambda: self._store_call(lambda s: s.check([self.PRINTED])) is not False, seconds=10.0)
            self.store = None
        return code

    def _left(self, peer: Peer) -> bool:
        if peer in self.local and not peer_alive(peer):
            return True
        return self._store_call(lambda s: s.check([self.LEFT + str(peer.rank)])) is not False

    @staticmethod
    def _wait_for(done: Callable[[], bool], seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not done() and time.monotonic() < deadline:
            time.sleep(0.05)

    def fail(self, err: BaseException) -> NoReturn:
        """The main thread's exception handler on a multi-rank job: one clear line, exit 1, no hang.
        Silent when the job is stopping on purpose (`stop_job`): then a collective broken by a peer that
        already left is the stop's echo, not a failure to report."""
        if self._stopping or self._store_call(lambda s: s.check([self.STOPPED])) is True:
            self._main_stopping.set()
            with self._ending:
                taken, self._stopping = self._stopping, True
            if taken:
                time.sleep(60.0)  # the watch thread is ending this rank
            sys.stdout.flush()
            os._exit(self._leave_stopped(1))
        cause = self._diagnose_within(3 * self.interval + 3.0)
        me = self.peers[self.world.rank]
        if cause:
            self._end(f"{me} stops: {cause} (here: {_short(err)})", post=None)
        traceback.print_exception(err)
        self._end(f"{me} failed: {_short(err)}", post=f"{me} failed ({_short(err)})")

    def lost_peers(self) -> list[Peer]:
        """Peers on this host whose process is gone without having said it leaves."""
        gone = [p for p in self.local if not peer_alive(p)]
        return [p for p in gone if self._store_call(lambda s, r=p.rank: s.check([self.LEFT + str(r)])) is not True]

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if self._store_call(lambda s: s.check([self.STOPPED])) is True:
                self._follow_stop()
                return
            lost = self.lost_peers()
            if lost and self._stop.wait(self.interval):  # this rank was leaving in good order itself
                return
            lost = self.lost_peers() if lost else lost  # a peer just leaving has said so by now
            if lost:
                self._end(f"{_gone(lost)}; {self.peers[self.world.rank]} stops too",
                          post=f"{_gone(lost)}, seen by rank {self.world.rank}")
            posted = self._posted()
            if posted:
                self._end(f"{self.peers[self.world.rank]} stops: {posted}", post=None)
            self._store_call(lambda s: s.add(self.BEAT + str(self.world.rank), 1))

    def _posted(self) -> str | None:
        if self._store_call(lambda s: s.check([self.LOST])) is True:
            return self._store_call(lambda s: s.get(self.LOST).decode())
        return None

    def _diagnose(self) -> str | None:
        """Why the job broke, as seen from here: a dead local peer, a posted finding, silent ranks."""
        lost = self.lost_peers()
        if lost:
            return _gone(lost)
        posted = self._posted()
        if posted:
            return posted
        others = [p for p in self.peers if p.rank != self.world.rank]
        first = self._store_call(lambda s: [s.add(self.BEAT + str(p.rank), 0) for p in others])
        if first is None:
            for _ in range(20):  # a killed rank's sockets close before its process is gone: look again, briefly
                lost = self.lost_peers()
                if lost:
                    return _gone(lost)
                time.sleep(0.1)
            return f"the rendezvous store on {self.peers[0]} does not answer: rank 0 is gone"
        time.sleep(2 * self.interval + 0.5)
        second = self._store_call(lambda s: [s.add(self.BEAT + str(p.rank), 0) for p in others]) or first
        silent = [p for p, a, b in zip(others, first, second) if a == b]
        return (", ".join(str(p) for p in silent) + " stopped responding") if silent else None

    def _diagnose_within(self, seconds: float) -> str | None:
        """`_diagnose` with a deadline: a store on a vanished host could block for the whole timeout."""
        found: list[str | None] = [None]
        helper = threading.Thread(target=lambda: found.__setitem__(0, self._diagnose()), daemon=True)
        helper.start()
        helper.join(seconds)
        return found[0]

    def _store_call(self, op: Callable[[Any], Any]) -> Any:
        """`op(store)`, or None when there is no store or it does not answer (rank 0 gone)."""
        if self.store is None:
            return None
        try:
            return op(self.store)
        except Exception:  # noqa: BLE001 -- a dead store is an expected state here, not an error
            self.store = None  # once is enough: every failed call makes torch log a stack trace
            return None

    def _end(self, line: str, post: str | None) -> NoReturn:
        """Post the finding for the other hosts, print one line, exit 1 without gloo's teardown."""
        with self._ending:  # the watch thread and the main thread must not both report
            if post:
                self._store_call(lambda s: s.set(self.LOST, post))
            print(f"bigtrain: {line}. Resume from the last complete checkpoint with --resume.",
                  file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(1)


def _print_lines(message: str) -> None:
    for line in message.splitlines() or [""]:
        print(f"bigtrain: {line}", file=sys.stderr, flush=True)


def _gone(peers: list[Peer]) -> str:
    return ", ".join(str(p) for p in peers) + (" is" if len(peers) == 1 else " are") + " gone (killed or crashed)"


def _short(err: BaseException) -> str:
    """`Type: first sentence`, without gloo's "[file.cc:537] " prefix and advice."""
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", str(err).strip().split("\n")[0])
    text = re.split(r"\. (?=[A-Z])", text, maxsplit=1)[0]
    return f"{type(err).__name__}: {text[:200]}"
