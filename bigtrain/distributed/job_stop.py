"""A job that stops on purpose (a user's mistake, a diverging loss, a full disk), seen by one rank or by all,
ends with one message and one exit code, never a hang and never a crash report.

The first rank to stop posts its message in the rendezvous store, rank 0 prints it, and every other rank leaves
without a word. Rank 0 (whose process holds the store under the deepspeed launcher) leaves last, so no peer's
store call fails with torch's C++ stack trace, and no peer takes rank 0's exit for a crash. A rank whose own
main thread does not see the stop (it is inside a collective, or its data differ) is ended by its peer watch
thread, which calls `follow` when it finds the stop posted.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable, NoReturn

from bigtrain.distributed.lifeline import ending_on_purpose
from bigtrain.distributed.peers import Peer, PeerStore, local_peers, peer_alive, print_lines
from bigtrain.distributed.world import World

STOPPED, PRINTED = "bigtrain/stopped", "bigtrain/stopped-printed"


class JobStop:
    """The coordinated stop of one rank. `ending` is this rank's one voice: whoever holds it (the stop, or the peer
    watch reporting a dead peer) is the only one to print and exit; `watching_over` ends the peer watch's thread."""

    FOLLOW_GRACE_S = 5.0

    def __init__(self, world: World, peers: list[Peer], store: PeerStore, interval: float = 1.0):
        self.world, self.peers, self.store, self.interval = world, peers, store, interval
        self.local = local_peers(peers, world.rank)
        self.ending = threading.Lock()
        self.watching_over = threading.Event()
        self._stopping = False  # this rank is ending for a stop (its main thread, or the watch following one)
        self._main_stopping = threading.Event()  # the main thread called `end`

    def end(self, message: str, code: int) -> int:
        """End the job on purpose: rank 0 prints `message` (or the one a peer posted first) as `bigtrain:` lines,
        the other ranks say nothing; returns the exit code, once every peer has left (bounded)."""
        self._main_stopping.set()
        with self.ending:
            taken = self._stopping
            self._stopping = True
            self.watching_over.set()
        if taken:  # the watch thread is already ending this rank for a peer's stop: it exits the process
            time.sleep(60.0)
            return code
        if self.store.store is None:  # a world of one (or the store is gone): this rank speaks for itself
            if self.world.is_main:
                print_lines(message)
            return code
        self.store.call(lambda s: s.compare_set(STOPPED, "", f"{code}\n{message}"))
        return self._leave(code)

    def posted(self) -> bool:
        """A rank has stopped the job."""
        return self.store.call(lambda s: s.check([STOPPED])) is True

    def under_way(self) -> bool:
        """This rank is ending for a stop, or a peer has posted one."""
        return self._stopping or self.posted()

    def follow(self) -> None:
        """The watch thread's side: a peer stopped the job, so this rank leaves too, unless its main thread gets
        there itself within a few seconds (a stop every rank sees alike: the main thread may be writing the
        summary)."""
        if self._main_stopping.wait(self.FOLLOW_GRACE_S):
            return
        with self.ending:
            if self._stopping:
                return
            self._stopping = True
        code = self._leave(1)
        sys.stdout.flush()
        os._exit(code)

    def leave_quietly(self) -> NoReturn:
        """The main thread's exception during a stop: a collective broken by a peer that already left is the
        stop's echo, not a failure to report."""
        self._main_stopping.set()
        with self.ending:
            taken, self._stopping = self._stopping, True
        if taken:
            time.sleep(60.0)  # the watch thread is ending this rank
        sys.stdout.flush()
        os._exit(self._leave(1))

    def _leave(self, code: int) -> int:
        posted = self.store.call(lambda s: s.get(STOPPED).decode()) or f"{code}\n"
        posted_code, _, message = posted.partition("\n")
        code = int(posted_code) if posted_code.isdigit() else code
        self.store.say_left(self.world.rank)
        if self.world.is_main:
            print_lines(message)
        ending_on_purpose(code)
        if self.world.is_main:
            self.store.call(lambda s: s.set(PRINTED, "1"))
            # a peer's watch thread follows a stop within FOLLOW_GRACE_S and its interval, even from inside a collective
            _wait_for(lambda: all(self._left(p) for p in self.peers if p.rank != 0),
                      seconds=3 * self.FOLLOW_GRACE_S + 3 * self.interval)
            time.sleep(0.2)  # the peers' last store reads return before the store goes
        else:  # leave once rank 0 has printed: a launcher ends every rank when the first one exits
            _wait_for(lambda: self.store.call(lambda s: s.check([PRINTED])) is not False, seconds=10.0)
            self.store.store = None
        return code

    def _left(self, peer: Peer) -> bool:
        if peer in self.local and not peer_alive(peer):
            return True
        return self.store.said_left(peer.rank) is not False


def _wait_for(done: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.05)
