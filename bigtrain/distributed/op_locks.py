"""Lock files a killed build of a DeepSpeed op left behind.

DeepSpeed JIT-builds its ops (FusedAdam on GPUs, CPU Adam for offload, the CPU all-reduce) through torch's
`cpp_extension`, which holds `<build root>/<op>/lock` while it compiles. A build killed part-way (a job
stopped during its first minutes) leaves the file, and every later build of that op waits on it forever,
printing nothing: a job that hangs before its first step (seen on an H200, 2026-11-27: 330 s until the
bench killed it). Checked before the engine is built: a lock young enough to be another job's build is a
warning, an older one is a one-line error naming the file to remove.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

STALE_AFTER_S = 30 * 60  # a build takes 1-3 minutes on these machines; no build holds its lock for half an hour


def build_root() -> Path:
    """Where torch builds JIT extensions: TORCH_EXTENSIONS_DIR, else its per-user cache."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    from torch.utils.cpp_extension import get_default_build_root
    return Path(get_default_build_root())


def build_locks(root: Path | None = None, now: float | None = None) -> list[tuple[Path, float]]:
    """Every build lock under `root` with its age in seconds (`root/<op>/lock`, or `root/pyXY_cuZ/<op>/lock`
    as torch lays out its default root)."""
    root = build_root() if root is None else Path(root)
    now = time.time() if now is None else now
    found = []
    for path in sorted({*root.glob("*/lock"), *root.glob("*/*/lock")}):
        try:
            found.append((path, now - path.stat().st_mtime))
        except OSError:  # the build finished and removed it meanwhile
            pass
    return found


def check_build_locks(root: Path | None = None, now: float | None = None) -> list[str]:
    """Warning lines for locks another job may hold; raises ValueError for one older than STALE_AFTER_S."""
    warnings = []
    for path, age in build_locks(root, now):
        op = path.parent.name
        if age >= STALE_AFTER_S:
            raise ValueError(f"a build of DeepSpeed's {op} op left its lock {path} {age / 60:.0f} min ago and was "
                             f"killed: every build of {op} waits on that file forever; if no other job is building "
                             f"it, remove it (rm {path}) and start again")
        warnings.append(f"another job is building DeepSpeed's {op} op (lock {path}, {age:.0f} s old): this job waits "
                        f"for it; if none is, a killed build left the file: remove it (rm {path})")
    return warnings


def clear_stale_build_locks(max_age_s: float = 600.0) -> list[str]:
    """Remove the build locks older than `max_age_s`; returns their paths. Torch's FileBaton polls a lock with no
    timeout, so a build that was killed would hang every later job before its first line; a build takes a minute
    or two (DeepSpeed builds its CPU all-reduce op while a rank joins the process group)."""
    removed = []
    for path, age in build_locks():
        if age > max_age_s:
            try:
                path.unlink()
                removed.append(str(path))
            except OSError:  # another rank removed it first, or it is not ours to remove
                pass
    return removed
