"""A CPU rank's host settings: its own share of the cores, and an allocator that keeps freed memory (or, for jobs
that offload to host RAM, gives it back); the host's CPU described once per process. Light: no torch until a rank
pins its threads.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Callable

from bigtrain.atomic import write_atomic


def tune_cpu_rank() -> None:
    """A CPU rank's fast defaults: pinned to its share of the cores, and malloc keeping freed memory."""
    local_size = int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1")))
    bind_to_cores(int(os.environ.get("LOCAL_RANK", "0")), local_size)
    keep_freed_memory()


def bind_to_cores(local_rank: int, local_size: int) -> list[int] | None:
    """Pin every thread of this process to its 1/local_size share of the cores, and use that many threads.

    What `deepspeed --bind_cores_to_rank` does with numactl, without needing numactl. Skipped
    (returns None) with BIGTRAIN_BIND_CORES=0, when the affinity is already narrower than the
    machine (numactl, taskset, a container's cpuset), or with fewer cores than ranks.
    """
    if os.environ.get("BIGTRAIN_BIND_CORES", "1") == "0" or not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < (os.cpu_count() or 0) or len(cores) < local_size or not 0 <= local_rank < local_size:
        return None
    share = len(cores) // local_size
    mine = cores[local_rank * share:(local_rank + 1) * share]
    for tid in os.listdir("/proc/self/task"):  # sched_setaffinity(0) would pin the calling thread only
        try:
            os.sched_setaffinity(int(tid), mine)
        except OSError:  # a thread that just ended
            pass
    import torch
    torch.set_num_threads(min(torch.get_num_threads(), share))
    return mine


def keep_freed_memory() -> bool:
    """glibc: never mmap (so never munmap) large blocks, never trim the heap; the process's RSS
    stays at its peak instead of faulting fresh pages in every step (large tensors such as the
    logits are otherwise mapped and unmapped every step; docs/benchmarks.md has the numbers).

    `bigtrain train` sets the same through GLIBC_TUNABLES (train_cli.MALLOC_TUNABLES); this is
    the run-time equivalent for a raw `deepspeed` launch. Skipped with BIGTRAIN_MALLOC_TUNING=0,
    when GLIBC_TUNABLES already sets malloc options, or off glibc.
    """
    if os.environ.get("BIGTRAIN_MALLOC_TUNING", "1") == "0" or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_max = -1, -4  # from glibc's malloc.h
        return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return False


def return_freed_memory() -> bool:
    """The opposite of `keep_freed_memory`, for jobs that offload to host RAM: glibc's defaults again
    (large blocks mmapped and unmapped, the heap trimmed), so freed memory goes back to the system.
    Measured: the largest GPT-2 that ZeRO-3 + offload fit in 20.7 GiB grew from 42 to 49 layers
    (docs/benchmarks.md, Capacity). Skipped with BIGTRAIN_MALLOC_TUNING=1, or off glibc."""
    if os.environ.get("BIGTRAIN_MALLOC_TUNING") == "1":
        return False
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_max = -1, -4  # from glibc's malloc.h; values below are glibc's defaults
        restored = bool(libc.mallopt(m_mmap_max, 65536)) and bool(libc.mallopt(m_trim_threshold, 128 * 1024))
        libc.malloc_trim(0)  # and hand back what is already free
        return restored
    except (OSError, AttributeError):
        return False


def describe_cpu_once() -> None:
    """py-cpuinfo's description of this host, asked once per process and kept for the machine's next processes.
    DeepSpeed asks for it six times as it builds an offloaded optimizer's CPU Adam (its op builder's flags, the
    optimizer's vendor check), and py-cpuinfo answers each time from Python processes of its own: ~3 CPU seconds
    and 4-6 s of an offloaded job's start on 2 cores; once, ~1 CPU s and 1.1 s; kept (`kept_cpu_description`), a
    file read."""
    import cpuinfo
    if getattr(cpuinfo.get_cpu_info, "asked_once", False):
        return
    ask = cpuinfo.get_cpu_info
    described = functools.cache(lambda: kept_cpu_description(ask))

    def get_cpu_info() -> dict:
        return copy.deepcopy(described())  # each caller its own dict, as before
    get_cpu_info.asked_once = True  # type: ignore[attr-defined]
    cpuinfo.get_cpu_info = get_cpu_info


def kept_cpu_description(ask: Callable[[], dict]) -> dict:
    """`ask()` (py-cpuinfo's description of this host), kept in bigtrain's machine-wide cache under a hash of what
    /proc/cpuinfo says of the CPU (its model, its flags; not the clock that moves) and of py-cpuinfo's version, so
    another CPU (a cache folder shared by other machines) or another py-cpuinfo never reads it. Asked anew where
    there is no /proc/cpuinfo, no cache (BIGTRAIN_CACHE=off) or an unreadable file."""
    path = _description_path()
    if path is not None:
        with contextlib.suppress(OSError, ValueError):
            found = json.loads(path.read_text())
            if isinstance(found, dict) and found:
                return found
    found = ask()
    if path is not None:
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(found))
    return found


def _description_path() -> Path | None:
    from bigtrain.machine_cache import cache_root
    root = cache_root()
    if root is None:
        return None
    try:
        described = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    import cpuinfo
    cpu = "\n".join(line for line in described.splitlines() if not line.startswith(("cpu MHz", "bogomips")))
    key = hashlib.sha256(f"py-cpuinfo {cpuinfo.CPUINFO_VERSION_STRING}\n{cpu}".encode()).hexdigest()[:20]
    return root / "cpu" / f"{key}.json"
