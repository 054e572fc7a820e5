"""A directory of .npy arrays written once by one rank and memory-mapped by all.

The writer builds the arrays into a temporary directory and renames it into place, so
the cache is either absent or complete: a crash mid-write, or a second writer on another
node sharing the filesystem, never leaves a half-written cache that others would load.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np


def cached_arrays(directory: Path, build: Callable[[], dict[str, np.ndarray]], is_writer: bool,
                  barrier: Callable[[], None]) -> dict[str, np.ndarray]:
    """Arrays from `directory`, built there first by the writer if missing.

    Every rank must call this (it contains a barrier). Pass `is_writer=True` on exactly one
    rank per filesystem (global rank 0 for a shared cache, local rank 0 for node-local ones).
    Arrays come back read-only and memory-mapped: ranks share the page cache.
    """
    directory = Path(directory)
    if is_writer and not directory.is_dir():
        _write(directory, build())
    barrier()
    if not directory.is_dir():
        raise RuntimeError(f"data cache {directory} is missing after the writer's barrier: no rank wrote it. "
                           "is_writer must be true on one rank per filesystem")
    return {p.stem: np.load(p, mmap_mode="r") for p in sorted(directory.glob("*.npy"))}


def _write(directory: Path, arrays: dict[str, np.ndarray]) -> None:
    assert arrays, "a cache entry needs at least one array"
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / f".{directory.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name, array in arrays.items():
        np.save(tmp / f"{name}.npy", np.ascontiguousarray(array))
    try:
        os.replace(tmp, directory)
    except OSError:
        if not directory.is_dir():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another writer finished the same entry first
