"""A peer that is gone ends the job with a line naming it, never a hang.

A SIGKILLed rank says nothing, and the others either fail with gloo's "Connection reset by peer", which names no
rank, or wait in an NCCL collective until the timeout; DeepSpeed's launcher then prints the command line of its
*last* rank, whichever rank died. So a daemon thread checks the peers on this host by pid every `interval`
seconds, posts what it finds in the rendezvous store for the ranks on other hosts, and exits the process.
`fail()` is the main thread's side: after an exception it names the dead peer if there is one, else this rank.
Ranks leaving in good order call `leave()` first, so a finished peer is not taken for a dead one. The same thread
follows a stop a peer posted (`bigtrain.distributed.job_stop`).
"""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import NoReturn

from bigtrain.distributed.job_stop import JobStop
from bigtrain.distributed.peers import Peer, PeerStore, gone, local_peers, peer_alive, short
from bigtrain.distributed.world import World

LOST, BEAT = "bigtrain/lost", "bigtrain/beat/"


class PeerWatch:
    """Ends this rank with a line naming the culprit when a peer process is gone."""

    def __init__(self, world: World, peers: list[Peer], store: PeerStore, stop: JobStop, interval: float = 1.0):
        self.world, self.peers, self.store, self.stop, self.interval = world, peers, store, stop, interval
        self.local = local_peers(peers, world.rank)
        self._thread = threading.Thread(target=self._run, name="bigtrain-peer-watch", daemon=True)

    @classmethod
    def start(cls, world: World, peers: list[Peer], store: PeerStore, stop: JobStop,
              interval: float = 1.0) -> "PeerWatch":
        """Start watching the peers; BIGTRAIN_PEER_WATCH=0 turns it off."""
        watch = cls(world, peers, store, stop, interval)
        if world.size > 1 and os.environ.get("BIGTRAIN_PEER_WATCH", "1") != "0":
            watch._thread.start()
        return watch

    def describe(self, limit: int = 16) -> str:
        shown = ", ".join(f"{p.rank} pid {p.pid} on {p.host}" for p in self.peers[:limit])
        return "ranks: " + shown + (f" ... ({len(self.peers)} in all)" if len(self.peers) > limit else "")

    def leave(self) -> None:
        """Stop watching and tell the peers this rank is leaving in good order."""
        self.stop.watching_over.set()
        self.store.say_left(self.world.rank)

    def fail(self, err: BaseException) -> NoReturn:
        """The main thread's exception handler on a multi-rank job: one clear line, exit 1, no hang.
        Silent when the job is stopping on purpose (`JobStop`)."""
        if self.stop.under_way():
            self.stop.leave_quietly()
        cause = self._diagnose_within(3 * self.interval + 3.0)
        me = self.peers[self.world.rank]
        if cause:
            self._end(f"{me} stops: {cause} (here: {short(err)})", post=None)
        traceback.print_exception(err)
        self._end(f"{me} failed: {short(err)}", post=f"{me} failed ({short(err)})")

    def end_if_a_peer_is_lost(self) -> None:
        """End this rank with the line naming a dead peer, if one is (before a signal's stop is announced)."""
        watching = self._thread.is_alive() and not self.stop.watching_over.is_set()
        lost = self.lost_peers() if watching else []
        if lost:
            self._end_for(lost)

    def lost_peers(self) -> list[Peer]:
        """Peers on this host whose process is gone without having said it leaves."""
        return [p for p in self.local if not peer_alive(p) and self.store.said_left(p.rank) is not True]

    def _run(self) -> None:
        over = self.stop.watching_over
        while not over.wait(self.interval):
            if self.stop.posted():
                self.stop.follow()
                return
            lost = self.lost_peers()
            if lost and over.wait(self.interval):  # this rank was leaving in good order itself
                return
            lost = self.lost_peers() if lost else lost  # a peer just leaving has said so by now
            if lost:
                self._end_for(lost)
            posted = self._posted()
            if posted:
                self._end(f"{self.peers[self.world.rank]} stops: {posted}", post=None)
            self.store.call(lambda s: s.add(BEAT + str(self.world.rank), 1))

    def _posted(self) -> str | None:
        if self.store.call(lambda s: s.check([LOST])) is True:
            return self.store.call(lambda s: s.get(LOST).decode())
        return None

    def _diagnose(self) -> str | None:
        """Why the job broke, as seen from here: a dead local peer, a posted finding, silent ranks."""
        lost = self.lost_peers()
        if lost:
            return gone(lost)
        posted = self._posted()
        if posted:
            return posted
        others = [p for p in self.peers if p.rank != self.world.rank]
        first = self.store.call(lambda s: [s.add(BEAT + str(p.rank), 0) for p in others])
        if first is None:
            for _ in range(20):  # a killed rank's sockets close before its process is gone: look again, briefly
                lost = self.lost_peers()
                if lost:
                    return gone(lost)
                time.sleep(0.1)
            return f"the rendezvous store on {self.peers[0]} does not answer: rank 0 is gone"
        time.sleep(2 * self.interval + 0.5)
        second = self.store.call(lambda s: [s.add(BEAT + str(p.rank), 0) for p in others]) or first
        silent = [p for p, a, b in zip(others, first, second) if a == b]
        return (", ".join(str(p) for p in silent) + " stopped responding") if silent else None

    def _diagnose_within(self, seconds: float) -> str | None:
        """`_diagnose` with a deadline: a store on a vanished host could block for the whole timeout."""
        found: list[str | None] = [None]
        helper = threading.Thread(target=lambda: found.__setitem__(0, self._diagnose()), daemon=True)
        helper.start()
        helper.join(seconds)
        return found[0]

    def _end_for(self, lost: list[Peer]) -> NoReturn:
        self._end(f"{gone(lost)}; {self.peers[self.world.rank]} stops too",
                  post=f"{gone(lost)}, seen by rank {self.world.rank}")

    def _end(self, line: str, post: str | None) -> NoReturn:
        """Post the finding for the other hosts, print one line, exit 1 without gloo's teardown."""
        with self.stop.ending:  # the watch thread, the main thread and a stop must not all report
            if post:
                self.store.call(lambda s: s.set(LOST, post))
            print(f"bigtrain: {line}. Resume from the last complete checkpoint with --resume.",
                  file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(1)

