"""The peers of a job: who they are (rank, host, pid), whether one is still running, and the rendezvous store
through which they tell each other what they see. The two protocols built on it: `peer_watch` (a peer that is
gone ends the job with a line naming it) and `job_stop` (a job stopped on purpose ends with one line from rank 0).
"""
from __future__ import annotations

import os
import re
import socket
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

from bigtrain.distributed.lifeline import process_alive
from bigtrain.distributed.world import World

LEFT = "bigtrain/left/"  # + rank: that rank leaves in good order (a finished peer is not a dead one)


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
    return process_alive(peer.pid, peer.started)


def local_peers(peers: list[Peer], rank: int) -> list[Peer]:
    """The other ranks on this rank's host that run now: only these can be looked at by pid (a pid namespace of
    their own must not look like a death)."""
    me = peers[rank]
    return [p for p in peers if p.host == me.host and p.rank != rank and peer_alive(p)]


class PeerStore:
    """The job's rendezvous store as the peers use it: a call that fails (rank 0, which holds the store under the
    deepspeed launcher, is gone) returns None, and later calls return None at once."""

    def __init__(self, store: Any):
        self.store = store

    @classmethod
    def of(cls, world: World) -> "PeerStore":
        """The process group's rendezvous store (none for a world of one)."""
        return cls(torch.distributed.distributed_c10d._get_default_store() if world.size > 1 else None)

    def call(self, op: Callable[[Any], Any]) -> Any:
        """`op(store)`, or None when there is no store or it does not answer."""
        if self.store is None:
            return None
        try:
            return op(self.store)
        except Exception:  # noqa: BLE001 -- a dead store is an expected state here, not an error
            self.store = None  # once is enough: every failed call makes torch log a stack trace
            return None

    def say_left(self, rank: int) -> None:
        self.call(lambda s: s.set(LEFT + str(rank), "1"))

    def said_left(self, rank: int) -> bool | None:
        """True / False, or None when the store does not answer."""
        return self.call(lambda s: s.check([LEFT + str(rank)]))


def print_lines(message: str) -> None:
    for line in message.splitlines() or [""]:
        print(f"bigtrain: {line}", file=sys.stderr, flush=True)


def gone(peers: list[Peer]) -> str:
    return ", ".join(str(p) for p in peers) + (" is" if len(peers) == 1 else " are") + " gone (killed or crashed)"


def short(err: BaseException) -> str:
    """`Type: first sentence`, without gloo's "[file.cc:537] " prefix and advice."""
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", str(err).strip().split("\n")[0])
    text = re.split(r"\. (?=[A-Z])", text, maxsplit=1)[0]
    return f"{type(err).__name__}: {text[:200]}"
