"""Python's cycle collector over a training process's start: paused while the imports and the set-up allocate, then,
before the first step, one collection and what survived it frozen out of every later collection's walk.

A rank's imports (torch, DeepSpeed, transformers) allocate millions of objects and hardly any cyclic garbage, and
each collection walks the survivors again: ~0.8 of a tiny one-rank job's 6.4 CPU seconds. Frozen, the half a million
objects of the libraries are not walked again by the collections the training loop triggers.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def paused_for_start() -> Iterator[None]:
    """The collector off until `settle` (the first step) or the end of the block, then as the caller had it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.enable() if was_enabled else gc.disable()


def settle() -> None:
    """Before the first step, where the start paused the collector: collect once, freeze the survivors, resume. A
    caller who keeps the collector on (several jobs in one process, each frozen after its end) is left alone."""
    if gc.isenabled():
        return
    gc.collect()
    gc.freeze()
    gc.enable()
