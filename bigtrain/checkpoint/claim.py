"""One run per output folder: a lock held for the job's lifetime, and no fresh run on top of another's checkpoints.

Two jobs writing one `--out` leave one job's checkpoints and summary silently gone; a fresh run into a
folder that holds an earlier run's checkpoints leaves both runs' tags side by side, and `bigtrain export`
then takes the newest, whichever run wrote it. So rank 0 takes an exclusive `flock` on OUT/.bigtrain.lock
(and on the checkpoint directory's, when `checkpoint.dir` lies elsewhere) before anything is written;
the kernel drops it when the process ends however it ends (kill -9 included), so a killed job never
leaves a stale lock. Then a run without `--resume` refuses a folder with checkpoints, unless
`--overwrite` asks to remove them (and the files that describe that run) first.
"""
from __future__ import annotations

import fcntl
import logging
import os
import shutil
import socket
import time
from pathlib import Path

import torch

from bigtrain.checkpoint.store import check_complete, checkpoint_tags
from bigtrain.distributed.world import World
from bigtrain.writable import unwritable

log = logging.getLogger("bigtrain")
LOCK_NAME = ".bigtrain.lock"
# What describes one run in its folder, removed with its checkpoints by --overwrite; the data cache and a
# trained tokenizer are keyed by their sources and stay (the next run reuses them when they match).
RUN_FILES = ("summary.json", "loss.png", "csv", "tensorboard")
BOTH_FLAGS = "--resume continues the run in --out and --overwrite deletes it: give one of them"


class RunDirLock:
    """Exclusive locks on a run's folders for this process's lifetime (or until `release`)."""

    def __init__(self) -> None:
        self._fds: list[int] = []

    def acquire(self, folder: Path) -> str | None:
        """Lock `folder`; None, or a line naming the job that holds it (or why the folder cannot be had)."""
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:  # found before the launcher (`unwritable`); a mount gone read-only since lands here
            return f"cannot write the run folder {folder} ({err.strerror}); give the run a folder you can write"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return _in_use(folder, fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
                  .encode(), 0)
        self._fds.append(fd)
        return None

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)  # closing the descriptor drops the flock
        self._fds.clear()


def _in_use(folder: Path, fd: int) -> str:
    """The line for a folder whose lock another job holds (`fd`: the lock file, closed here)."""
    holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
    os.close(fd)
    return f"{folder} is in use by another bigtrain job ({holder}); wait for it to end, or give this run another --out"


def held_by_another(folder: Path) -> str | None:
    """The in-use line when a job holds `folder`'s lock, found without taking it (a shared lock for a moment, which
    every rank of a starting job may take at once) and without creating anything; None otherwise."""
    try:
        fd = os.open(folder / LOCK_NAME, os.O_RDONLY)
    except OSError:  # no lock file: no job has run here, or the folder does not exist yet
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return _in_use(folder, fd)
    os.close(fd)  # closing drops the shared lock
    return None


def run_dir_problem(out: Path, ckpt_dir: Path, *, resume: bool, overwrite: bool) -> str | None:
    """What `claim_run_dir` would refuse, found before any rank starts, reading only (`bigtrain train` and run.py ask
    it first): the flags, a job holding the folders, an earlier run's checkpoints. The claim checks again."""
    if resume and overwrite:
        return BOTH_FLAGS
    for folder in run_folders(out, ckpt_dir):
        flag = "--out" if folder == out else "checkpoint.dir"
        if problem := unwritable(folder, flag) or held_by_another(folder):
            return problem
    if line := model_folder_line(out):
        return line
    complete = complete_tags(ckpt_dir) if not overwrite else []
    if resume:
        return None if complete else nothing_to_resume_line(ckpt_dir)
    return earlier_run_line(ckpt_dir, complete) if complete else None


def model_folder_line(out: Path) -> str | None:
    """A model directory (an export, a save_pretrained) is no run folder: a run written into it would sit beside
    those weights, and `bigtrain generate OUT` would serve the old model."""
    from bigtrain.models.names import has_weights
    if (out / "config.json").is_file() and has_weights(out):
        return (f"--out {out} holds a model (config.json and its weights), not a run: give the run a folder of its "
                "own")
    return None


def run_folders(out: Path, ckpt_dir: Path) -> list[Path]:
    """The folders a run writes and locks: OUT, and the checkpoint directory when it lies elsewhere."""
    return [out] + ([] if ckpt_dir.resolve().is_relative_to(out.resolve()) else [ckpt_dir])


def complete_tags(ckpt_dir: Path, tags: list[str] | None = None) -> list[str]:
    tags = checkpoint_tags(ckpt_dir) if tags is None else tags
    return [tag for tag in tags if check_complete(ckpt_dir / tag) is None]


def nothing_to_resume_line(ckpt_dir: Path) -> str:
    return f"--resume: no complete checkpoint in {ckpt_dir}; drop --resume to start fresh"


def earlier_run_line(ckpt_dir: Path, complete: list[str]) -> str:
    return (f"{ckpt_dir} holds the checkpoints of an earlier run (newest {complete[-1]}): continue that run with "
            "--resume, give this run another --out, or pass --overwrite to delete them first")


def claim_run_dir(out: Path, ckpt_dir: Path, world: World, *, resume: bool, overwrite: bool) -> RunDirLock:
    """Collective. Rank 0 locks the run's folders and checks that this run may write there; every rank raises
    the same one-line ValueError when it may not. The lock is rank 0's (the others get an empty one)."""
    lock = RunDirLock()
    problem = _claim_on_rank_0(out, ckpt_dir, lock, resume, overwrite) if world.is_main else None
    if world.size > 1 and torch.distributed.is_initialized():
        shared = [problem]
        torch.distributed.broadcast_object_list(shared, src=0)
        problem = shared[0]
    if problem:
        lock.release()
        raise ValueError(problem)
    return lock


def _claim_on_rank_0(out: Path, ckpt_dir: Path, lock: RunDirLock, resume: bool, overwrite: bool) -> str | None:
    if resume and overwrite:
        return BOTH_FLAGS
    for folder in run_folders(out, ckpt_dir):
        problem = lock.acquire(folder)
        if problem:
            lock.release()
            return problem
    if resume:
        return None
    tags = checkpoint_tags(ckpt_dir)
    complete = complete_tags(ckpt_dir, tags)
    if not complete:  # only the debris of a save that was killed: never resumable, and in this run's way
        if tags:
            remove_earlier_run(out, ckpt_dir, tags, run_files=False)
            log.warning("removed %d incomplete checkpoint(s) left in %s by an earlier job", len(tags), ckpt_dir)
        return None
    if not overwrite:
        return earlier_run_line(ckpt_dir, complete)
    remove_earlier_run(out, ckpt_dir, tags)
    log.warning("--overwrite: removed %d checkpoint(s) of an earlier run from %s (newest %s) and its summary",
                len(tags), ckpt_dir, tags[-1])
    return None


def remove_earlier_run(out: Path, ckpt_dir: Path, tags: list[str], run_files: bool = True) -> None:
    for tag in tags:
        shutil.rmtree(ckpt_dir / tag, ignore_errors=True)
        shutil.rmtree(ckpt_dir / f"{tag}_universal", ignore_errors=True)
    for name in RUN_FILES if run_files else ():
        path = out / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink()
