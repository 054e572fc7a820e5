"""Python's cycle collector over a training process's start: paused while the imports and the set-up allocate; the
libraries frozen out of every collection's walk once imported (`keep_libraries`); then, before the first step, one
collection of what the job built and what survived it frozen too (`settle`).

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


def keep_libraries() -> None:
    """Where the start paused the collector, once the libraries are imported: what they allocated is frozen at
    once, so that the collection before the first step walks only what the job built (0.35 of a tiny rank's CPU
    seconds walked the libraries' 600,000 objects to free 5,000: that garbage, ~6 MB, is kept instead). The job's
    own garbage, which can hold a device's tensors, is still collected by `settle`."""
    if not gc.isenabled():
        gc.freeze()


def settle() -> None:
    """Before the first step, where the start paused the collector: collect once, freeze the survivors, resume. A
    caller who keeps the collector on (several jobs in one process, each frozen after its end) is left alone."""
    if gc.isenabled():
        return
    gc.collect()
    gc.freeze()
    gc.enable()
