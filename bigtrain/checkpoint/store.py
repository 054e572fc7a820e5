"""Save and resume through DeepSpeed's checkpoints, so that a kill at any moment loses nothing.

Layout: CKPT_DIR/step_000120/ holds DeepSpeed's files for that step, one `rng_rank{r}.pt`
per rank, and, written last by rank 0 after every rank finished, `bigtrain.json` (the saved
`CheckpointState` and every file's size and digest). A tag directory without that marker is incomplete
(the job died while saving), and one with a listed file missing, cut short or changed is damaged:
neither is used (`integrity`). Loading never runs code from the files (`safe_load`).
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import random
import re
import shutil
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from bigtrain.atomic import write_atomic
from bigtrain.checkpoint.integrity import DIGESTS, MANIFEST, check_complete, damaged_files, digests, tag_files
from bigtrain.checkpoint.safe_load import checkpoint_loading, load_torch_file
from bigtrain.checkpoint.state import MARKER, CheckpointState, read_state
from bigtrain.distributed.world import World, barrier

__all__ = ["MANIFEST", "MARKER", "DiskFull", "check_complete", "find_resumable", "load", "save", "tag_for",
           "write_marker"]
log = logging.getLogger("bigtrain")
# Whole weights of a tensor-parallel ZeRO-3 checkpoint, gathered at save: DeepSpeed's ds_to_universal cannot read
# that layout when the model was built under zero.Init (it records the weights' shapes from before AutoTP split
# them), so export takes the weights from here.
TP_WEIGHTS = "tp_gathered_weights.pt"
TAG_RE = re.compile(r"^step_(\d+)$")


def tag_for(step: int) -> str:
    return f"step_{step:06d}"


class DiskFull(ValueError):
    """The disk filled up during a save: one line for the user, not torch's C++ frames."""


def save(ds_engine: Any, ckpt_dir: str | Path, step: int, state: CheckpointState, world: World,
         keep_last: int, rank_state: dict | None = None) -> Path:
    """Collective: every rank calls it. `state` (step, data position, config...) goes in the marker only;
    `rank_state` (this rank's own: an objective's random stream, tensors and plain values) beside this rank's RNG
    state, as its "objective" entry (`restore_rng` gives it back)."""
    ckpt_dir = Path(ckpt_dir)
    tag = tag_for(step)
    if world.is_main:  # a tag saved again (a resumed run passing it once more) is incomplete until re-marked
        (ckpt_dir / tag / MARKER).unlink(missing_ok=True)
    with _disk_full_as_one_line(ckpt_dir, tag):
        ds_engine.save_checkpoint(str(ckpt_dir), tag=tag)
        saved = rng_state()
        if rank_state:
            saved["objective"] = rank_state
        torch.save(saved, ckpt_dir / tag / f"rng_rank{world.rank}.pt")
        if _autotp_size(ds_engine) > 1 and ds_engine.zero_optimization_stage() == 3:
            gathered = ds_engine._consolidated_16bit_state_dict()  # collective: whole weights on rank 0
            if world.is_main:
                torch.save(gathered, ckpt_dir / tag / TP_WEIGHTS)
    barrier()  # every rank's files are on disk before the marker says so
    names = tag_files(ckpt_dir / tag)
    hashed = digests(ckpt_dir / tag, names, world)  # every rank hashes a share of the files
    if world.is_main:
        with _disk_full_as_one_line(ckpt_dir, tag):
            write_marker(ckpt_dir / tag, state, hashed)
        _prune(ckpt_dir, keep_last)
    barrier()
    return ckpt_dir / tag


def _autotp_size(ds_engine: Any) -> int:
    size = getattr(ds_engine, "autotp_size", None)
    return int(size() or 1) if callable(size) else 1


def write_marker(tag_dir: Path, state: CheckpointState, hashed: dict[str, str] | None = None) -> None:
    """Declare `tag_dir` complete: `state` plus every file's name, size and digest (`hashed`, else computed here),
    so a deleted, truncated or overwritten file is caught."""
    names = tag_files(tag_dir)
    hashed = hashed if hashed is not None else digests(tag_dir, names)
    sizes = {name: (tag_dir / name).stat().st_size for name in names}
    write_atomic(tag_dir / MARKER, json.dumps({**state.to_json(tag_dir), MANIFEST: sizes,
                                                DIGESTS: {n: hashed[n] for n in names if n in hashed}}, indent=2))


def find_resumable(ckpt_dir: str | Path, world: World | None = None) -> tuple[str, CheckpointState] | None:
    """Newest complete, undamaged checkpoint (tag, state); incomplete or damaged ones are skipped with a warning.
    Every file's bytes are checked against the digests recorded at save time: a collective when `world` has
    several ranks (each reads a share, and rank 0's view of which tags are complete decides for all).
    ValueError for a complete one of a layout version this bigtrain does not read (never skipped:
    resuming from an older step instead would silently lose work)."""
    ckpt_dir = Path(ckpt_dir)
    for tag in checkpoint_tags(ckpt_dir)[::-1]:
        problem = _agreed(check_complete(ckpt_dir / tag), world)
        if problem is None:
            damaged = damaged_files(ckpt_dir / tag, world)
            if damaged:
                problem = (f"{', '.join(damaged[:3])} changed since it was saved (its bytes no longer match the "
                           "digest in the marker: the file is damaged)")
        if problem is None:
            return tag, read_state(ckpt_dir / tag)
        if world is None or world.is_main:
            log.warning("skipping checkpoint %s: %s; using an earlier one", ckpt_dir / tag, problem)
    return None


def set_aside(tag_dir: Path, world: World) -> Path:
    """Collective: rename a checkpoint out of resume's and export's way (`step_N_diverged`), keeping its files."""
    target = tag_dir.with_name(f"{tag_dir.name}_diverged")
    if world.is_main:
        n = 1
        while target.exists():
            n += 1
            target = tag_dir.with_name(f"{tag_dir.name}_diverged{n}")
        tag_dir.rename(target)
        latest = tag_dir.parent / "latest"  # DeepSpeed's pointer, read by its zero_to_fp32 script
        if latest.is_file() and latest.read_text().strip() == tag_dir.name:
            newest = newest_complete(tag_dir.parent)
            write_atomic(latest, newest) if newest else latest.unlink()
    shared = [target]
    if world.size > 1 and torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(shared, src=0)
    return shared[0]


def newest_complete(ckpt_dir: Path, before: str | None = None) -> str | None:
    """The newest tag that passes the cheap check, older than `before` (for messages, not for loading)."""
    for tag in checkpoint_tags(ckpt_dir)[::-1]:
        if (before is None or _step_of(tag) < _step_of(before)) and check_complete(ckpt_dir / tag) is None:
            return tag
    return None


def _agreed(problem: str | None, world: World | None) -> str | None:
    """Rank 0's answer on every rank: the collective checks that follow must run on all ranks or none."""
    if world is None or world.size == 1 or not torch.distributed.is_initialized():
        return problem
    shared = [problem]
    torch.distributed.broadcast_object_list(shared, src=0)
    return shared[0]


@contextlib.contextmanager
def _disk_full_as_one_line(ckpt_dir: Path, tag: str) -> Iterator[None]:
    try:
        yield
    except (OSError, RuntimeError) as err:
        free = shutil.disk_usage(ckpt_dir).free if ckpt_dir.exists() else 0
        if not _is_disk_full(err, free):
            raise
        last = newest_complete(ckpt_dir, before=tag)
        kept = (f"the last complete checkpoint, {ckpt_dir / last}, is kept" if last
                else "no earlier complete checkpoint exists")
        raise DiskFull(f"the disk holding {ckpt_dir} is full ({free / 2**20:.0f} MB free) while saving checkpoint "
                       f"{tag}: {kept} and the incomplete {tag} is skipped on resume; free some space (or lower "
                       "checkpoint.keep_last) and continue with --resume") from None


def _is_disk_full(err: BaseException, free_bytes: int) -> bool:
    """Python says errno 28; torch's zip writer says only "unexpected pos ..." or "file write failed", which other
    write errors could say too, so those count when the disk is (nearly) full as well."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(seen)
        if "No space left on device" in text or (
                ("unexpected pos" in text or "file write failed" in text) and free_bytes < 1 << 30):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


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


def checkpoint_tags(ckpt_dir: Path) -> list[str]:
    """The step_N directories in `ckpt_dir`, complete or not, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    return sorted((p.name for p in ckpt_dir.iterdir() if p.is_dir() and TAG_RE.match(p.name)), key=_step_of)


def _step_of(tag: str) -> int:
    match = TAG_RE.match(tag)
    assert match, tag
    return int(match.group(1))


def _prune(ckpt_dir: Path, keep_last: int) -> None:
    """Remove all but the newest `keep_last` complete checkpoints; incomplete ones older than those go too."""
    tags = checkpoint_tags(ckpt_dir)[::-1]
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
