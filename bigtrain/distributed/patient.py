"""Waiting without the collective timeout: for a rank that prepares data, downloads a model or reads a line a
person types, the others wait through the process group's TCP store, polled, instead of in a gloo or NCCL
collective, which gives up after DEEPSPEED_TIMEOUT (2 minutes in the tests, 10 by default). A rank that dies
meanwhile still ends the job (bigtrain.distributed.peer_watch), so no wait here outlives the job.
"""
from __future__ import annotations

import itertools
import time
from typing import Any, Callable

import torch

_JOBS = itertools.count()  # the store outlives a job: a process that runs several must not reuse keys
_SHARED = itertools.count()


def _store() -> Any | None:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    if torch.distributed.get_world_size() == 1:
        return None
    return torch.distributed.distributed_c10d._get_default_store()


def _poll(ready: Callable[[], bool]) -> None:
    for n in itertools.count():
        if ready():
            return
        time.sleep(min(1.0, 0.01 * 2 ** n))


def patient_barrier(world_size: int) -> Callable[[], None]:
    """A barrier over the `world_size` ranks of the default group, as long as it takes (rank 0 may tokenize a
    corpus for longer than DEEPSPEED_TIMEOUT)."""
    store = _store() if world_size > 1 else None
    if store is None:
        return lambda: None
    calls = itertools.count()
    job = next(_JOBS)

    def wait() -> None:
        key = f"bigtrain/data-barrier/{job}/{next(calls)}"
        store.add(key, 1)
        _poll(lambda: store.add(key, 0) >= world_size)

    return wait


def from_rank0(produce: Callable[[], str] | None) -> str | None:
    """Rank 0's `produce()` on every rank (None on a world of one whose `produce` is None): rank 0 computes it,
    the others wait for it as long as it takes. Every rank calls this the same number of times, in the same order
    (the calls are numbered), with `produce` given on rank 0 (others may pass it too; it is not called)."""
    store = _store()
    if store is None:
        return produce() if produce is not None else None
    key = f"bigtrain/from-rank0/{next(_SHARED)}"
    if torch.distributed.get_rank() == 0:
        assert produce is not None, "rank 0 produces what the others wait for"
        value = produce()
        store.set(key, value)
        return value
    _poll(lambda: store.check([key]))
    return store.get(key).decode()
