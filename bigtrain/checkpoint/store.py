"""Save and resume through DeepSpeed's checkpoints, so that a kill at any moment loses nothing.

Layout: CKPT_DIR/step_000120/ holds DeepSpeed's files for that step, one `rng_rank{r}.pt`
per rank, and, written last by rank 0 after every rank finished, `bigtrain.json` (the saved
state and the list of files). A tag directory without that marker is incomplete (the job died
while saving), and one with a listed file missing or a torch file cut short is damaged: neither is used.
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

from bigtrain.distributed.world import barrier

log = logging.getLogger("bigtrain")
MARKER = "bigtrain.json"
MANIFEST = "files"  # in the marker: relative path -> size in bytes of every file of the tag at save time
TAG_RE = re.compile(r"^step_(\d+)$")


def tag_for(step: int) -> str:
    return f"step_{step:06d}"


def save(ds_engine: Any, ckpt_dir: str | Path, step: int, state: dict, rank: int, keep_last: int) -> Path:
    """Collective: every rank calls it. `state` (step, data position, config...) goes in the marker."""
    ckpt_dir = Path(ckpt_dir)
    tag = tag_for(step)
    ds_engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={"bigtrain": state})
    torch.save(rng_state(), ckpt_dir / tag / f"rng_rank{rank}.pt")
    barrier()  # every rank's files are on disk before the marker says so
    if rank == 0:
        write_marker(ckpt_dir / tag, state)
        _prune(ckpt_dir, keep_last)
    barrier()
    return ckpt_dir / tag


def write_marker(tag_dir: Path, state: dict) -> None:
    """Declare `tag_dir` complete: `state` plus every file's name and size, so a deleted file is caught."""
    files = {str(p.relative_to(tag_dir)): p.stat().st_size for p in sorted(tag_dir.rglob("*"))
             if p.is_file() and p.name != MARKER and not p.name.endswith(".tmp")}
    _write_atomic(tag_dir / MARKER, json.dumps({**state, MANIFEST: files}, indent=2))


def find_resumable(ckpt_dir: str | Path) -> tuple[str, dict] | None:
    """Newest complete checkpoint (tag, state); incomplete or corrupt ones are skipped with a warning."""
    for tag in sorted(_tags(Path(ckpt_dir)), key=_step_of, reverse=True):
        problem = check_complete(Path(ckpt_dir) / tag)
        if problem is None:
            return tag, json.loads((Path(ckpt_dir) / tag / MARKER).read_text())
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


def load(ds_engine: Any, ckpt_dir: str | Path, tag: str, rank: int, load_optimizer: bool = True) -> dict:
    """Restore model, optimizer, scheduler and this rank's RNG; returns the saved bigtrain state."""
    path, client = ds_engine.load_checkpoint(str(ckpt_dir), tag=tag, load_optimizer_states=load_optimizer,
                                             load_lr_scheduler_states=load_optimizer)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {ckpt_dir}/{tag}")
    rng_file = Path(ckpt_dir) / tag / f"rng_rank{rank}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return (client or {}).get("bigtrain", {})


def rng_state() -> dict:
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if acc.device_name() != "cpu":
        state["device"] = acc.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from deepspeed.accelerator import get_accelerator
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
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
