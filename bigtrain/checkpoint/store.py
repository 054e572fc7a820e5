"""Save and resume through DeepSpeed's checkpoints, so that a kill at any moment loses nothing.

Layout: CKPT_DIR/step_000120/ holds DeepSpeed's files for that step, one `rng_rank{r}.pt`
per rank, and, written last by rank 0 after every rank finished, `bigtrain.json` (the saved
`CheckpointState` and the list of files). A tag directory without that marker is incomplete (the
job died while saving), and one with a listed file missing or a torch file cut short is damaged:
neither is used. Loading never runs code from the files (`safe_load`).
"""
from __future__ import annotations

import json
import logging
import random
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bigtrain.checkpoint.safe_load import checkpoint_loading, load_torch_file
from bigtrain.checkpoint.state import MARKER, CheckpointState, read_state
from bigtrain.distributed.world import barrier

log = logging.getLogger("bigtrain")
MANIFEST = "files"  # in the marker: relative path -> size in bytes of every file of the tag at save time
TAG_RE = re.compile(r"^step_(\d+)$")


def tag_for(step: int) -> str:
    return f"step_{step:06d}"


def save(ds_engine: Any, ckpt_dir: str | Path, step: int, state: CheckpointState, rank: int,
         keep_last: int) -> Path:
    """Collective: every rank calls it. `state` (step, data position, config...) goes in the marker only."""
    ckpt_dir = Path(ckpt_dir)
    tag = tag_for(step)
    ds_engine.save_checkpoint(str(ckpt_dir), tag=tag)
    torch.save(rng_state(), ckpt_dir / tag / f"rng_rank{rank}.pt")
    barrier()  # every rank's files are on disk before the marker says so
    if rank == 0:
        write_marker(ckpt_dir / tag, state)
        _prune(ckpt_dir, keep_last)
    barrier()
    return ckpt_dir / tag


def write_marker(tag_dir: Path, state: CheckpointState) -> None:
    """Declare `tag_dir` complete: `state` plus every file's name and size, so a deleted file is caught."""
    files = {str(p.relative_to(tag_dir)): p.stat().st_size for p in sorted(tag_dir.rglob("*"))
             if p.is_file() and p.name != MARKER and not p.name.endswith(".tmp")}
    _write_atomic(tag_dir / MARKER, json.dumps({**state.to_json(tag_dir), MANIFEST: files}, indent=2))


def find_resumable(ckpt_dir: str | Path) -> tuple[str, CheckpointState] | None:
    """Newest complete checkpoint (tag, state); incomplete or corrupt ones are skipped with a warning.
    ValueError for a complete one of a layout version this bigtrain does not read (never skipped:
    resuming from an older step instead would silently lose work)."""
    for tag in sorted(_tags(Path(ckpt_dir)), key=_step_of, reverse=True):
        problem = check_complete(Path(ckpt_dir) / tag)
        if problem is None:
            return tag, read_state(Path(ckpt_dir) / tag)
        log.warning("skipping checkpoint %s: %s; using an earlier one", Path(ckpt_dir) / tag, problem)
    return None


def check_complete(tag_dir: Path) -> str | None:
    """Why `tag_dir` cannot be resumed from, or None if it can."""
    marker = tag_dir / MARKER
    if not marker.is_file():
        return "no completion marker (the save was interrupted)"
    try:
        state = json.loads(marker.read_text())
    except json.JSONDecodeError:
        return "its completion marker is not valid JSON"
    world = int(state.get("world_size", 1))
    expected = set(state.get(MANIFEST) or {}) | {f"rng_rank{r}.pt" for r in range(world)}
    missing = sorted(name for name in expected if not (tag_dir / name).is_file())
    if missing:
        return f"missing {', '.join(missing[:3])}" + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    return _damaged_file(tag_dir, state.get(MANIFEST) or {})


def _damaged_file(tag_dir: Path, sizes: dict) -> str | None:
    """The first torch file that is empty or cut short. torch.save writes a zip archive whose
    directory sits at the end, so a truncated file fails `is_zipfile`, which reads only the tail.
    A file rewritten whole (a converted checkpoint) is still a complete archive and passes."""
    for path in sorted(tag_dir.rglob("*.pt")):
        name, size = str(path.relative_to(tag_dir)), path.stat().st_size
        if size == 0:
            return f"{name} is empty"
        if not zipfile.is_zipfile(path):
            saved = f", {sizes[name]} when it was saved" if name in sizes else ""
            return f"{name} is truncated or corrupt (not a complete torch file: {size} bytes{saved})"
    return None


def load(ds_engine: Any, ckpt_dir: str | Path, tag: str, load_optimizer: bool = True, trust: bool = False) -> None:
    """Restore model, optimizer and scheduler (the RNG: `universal.restore_rng`, the one place).

    DeepSpeed's own torch.load calls run weights-only with the allow-list unless `trust`
    (`--trust-checkpoint`): a file that needs more is refused with one line naming the type.
    """
    with checkpoint_loading(Path(ckpt_dir) / tag, trust):
        path, _ = ds_engine.load_checkpoint(str(ckpt_dir), tag=tag, load_optimizer_states=load_optimizer,
                                            load_lr_scheduler_states=load_optimizer)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {ckpt_dir}/{tag}")


def rng_state() -> dict:
    """This process's RNG streams, as tensors and plain values only (loadable weights-only)."""
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))}
    if acc.device_name() != "cpu":
        state["device"] = acc.get_rng_state()
    return state


def load_rng_file(path: Path, trust: bool = False) -> dict:
    """An `rng_rank{r}.pt` file, weights-only unless `trust` (see `safe_load`)."""
    return load_torch_file(path, trust=trust)


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` saved (numpy's keys as a tensor, or as an array in layout-1 files)."""
    from deepspeed.accelerator import get_accelerator
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.int64).astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "device" in state:
        get_accelerator().set_rng_state(state["device"])


def _tags(ckpt_dir: Path) -> list[str]:
    if not ckpt_dir.is_dir():
        return []
    return [p.name for p in ckpt_dir.iterdir() if p.is_dir() and TAG_RE.match(p.name)]


def _step_of(tag: str) -> int:
    match = TAG_RE.match(tag)
    assert match, tag
    return int(match.group(1))


def _prune(ckpt_dir: Path, keep_last: int) -> None:
    """Remove all but the newest `keep_last` complete checkpoints; incomplete ones older than those go too."""
    tags = sorted(_tags(ckpt_dir), key=_step_of, reverse=True)
    keep: set[str] = set()
    for tag in tags:  # newest first, and only until enough are found: checking reads every file's tail
        if len(keep) < keep_last and check_complete(ckpt_dir / tag) is None:
            keep.add(tag)
    oldest_kept = min((_step_of(t) for t in keep), default=0)
    for tag in tags:
        if tag not in keep and _step_of(tag) < oldest_kept:
            shutil.rmtree(ckpt_dir / tag, ignore_errors=True)
            # its conversion for a resume at another shape (bigtrain.checkpoint.universal), if one was made
            shutil.rmtree(ckpt_dir / f"{tag}_universal", ignore_errors=True)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
