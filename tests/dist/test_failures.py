"""Failures: a SIGKILLed rank ends the job within 60 s with a line naming it; the last complete
checkpoint resumes, skipping a corrupt one; a peer dying inside a save leaves no completion marker
(checkpoint completeness without ranks: tests/unit/test_checkpoint_completeness.py)."""
from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import torch

from bigtrain.checkpoint import store as checkpoint
from bigtrain.checkpoint.state import CheckpointState
from bigtrain.distributed.world import World
from launch import REPO, TINY, deepspeed_cmd, free_port, launch_ranks, rank_env, summary
from messages import error_lines, naming

RANKS_LINE = re.compile(r"ranks: 0 pid (\d+) on (\S+), 1 pid (\d+) on (\S+)")
KILL_ARGS = [*TINY, "--steps", "400", "--set", "logging.interval=1", "--set", "train.eval_interval=0",
             "--set", "checkpoint.interval=2", "--set", "checkpoint.keep_last=2"]


def start_and_kill(out: Path, victim: int, after_step: int) -> tuple[str, float, int, int]:
    """Start a 2-rank run, SIGKILL rank `victim` once step `after_step` is logged.

    Returns (log, seconds from the kill to the job's exit, exit status, the victim's pid)."""
    proc = subprocess.Popen(deepspeed_cmd(REPO / "bigtrain" / "run.py", ["--out", str(out), *KILL_ARGS]), cwd=REPO,
                            env=rank_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines, pids = [], {}
    deadline = time.monotonic() + 240
    try:
        for line in proc.stdout:
            lines.append(line)
            found = RANKS_LINE.search(line)
            if found:
                pids = {0: int(found.group(1)), 1: int(found.group(3))}
            if line.startswith(f"step {after_step}/400") or time.monotonic() > deadline:
                break
        assert pids and line.startswith(f"step {after_step}/400"), "".join(lines)[-3000:]
        os.kill(pids[victim], signal.SIGKILL)
        killed = time.monotonic()
        rest, _ = proc.communicate(timeout=120)
        return "".join(lines) + rest, time.monotonic() - killed, proc.returncode, pids[victim]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def assert_named(log: str, victim: int, pid: int) -> None:
    survivor = 1 - victim
    line = next(iter(error_lines(log)), "")  # a warning of another job's op build may come first
    assert naming(line, f"rank {victim} (pid {pid} on ", "gone"), log[-4000:]
    assert f"rank {survivor} (pid" in line and "--resume" in line, line


def test_sigkill_names_the_rank_then_resume_skips_a_corrupt_checkpoint(tmp_path):
    out = tmp_path / "run"
    log, seconds, code, pid = start_and_kill(out, victim=1, after_step=7)
    assert code != 0 and seconds < 60, (code, seconds, log[-3000:])
    assert_named(log, victim=1, pid=pid)
    ckpt = out / "checkpoints"
    tags = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_"))
    for tag in tags:  # whatever the kill interrupted, nothing incomplete looks complete
        assert (ckpt / tag / checkpoint.MARKER).is_file() == (checkpoint.check_complete(ckpt / tag) is None), tag
    newest, state = checkpoint.find_resumable(ckpt)
    step = state.step
    assert step >= 6 and step % 2 == 0 and state.world_size == 2

    # Truncate the largest file of the newest complete checkpoint: resume must use the one before.
    victim_file = max((ckpt / newest).glob("*.pt"), key=lambda p: p.stat().st_size)
    with open(victim_file, "r+b") as f:
        f.truncate(victim_file.stat().st_size // 2)
    # The resume is about which checkpoint it takes, not the launcher: ranks started as torchrun starts them.
    proc = launch_ranks(REPO / "bigtrain" / "run.py", ["--out", str(out), *KILL_ARGS, "--resume", "--stop-after",
                                                       str(step)], 2, env=rank_env(), timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    assert naming(log, "skipping checkpoint", str(ckpt / newest), victim_file.name, "truncated or corrupt"), log[-3000:]
    assert naming(log, "resumed from", str(ckpt / checkpoint.tag_for(step - 2)), f"step {step - 2}"), log[-3000:]
    resumed = summary(out)
    assert resumed["steps"] == step and len(resumed["losses"]) == step
    # Steps step-1 and step, recomputed from step-2, equal what the killed run logged for them.
    assert max(abs(a - b) for a, b in zip(resumed["losses"][-2:], state.losses[-2:])) <= 1e-6, (resumed, state)


def test_sigkill_of_rank_0_is_named_by_rank_1(tmp_path):
    log, seconds, code, pid = start_and_kill(tmp_path / "run", victim=0, after_step=3)
    assert code != 0 and seconds < 60, (code, seconds, log[-3000:])
    assert_named(log, victim=0, pid=pid)


# --- a peer that dies inside a save: the marker is never written ----------------------------------

class FileWritingEngine:
    """Just the part of a DeepSpeed engine that `checkpoint.save` calls: write this rank's states."""

    def __init__(self, rank: int):
        self.rank = rank

    def save_checkpoint(self, save_dir: str, tag: str) -> None:
        Path(save_dir, tag).mkdir(parents=True, exist_ok=True)
        torch.save({"rank": self.rank}, Path(save_dir, tag, f"states_rank{self.rank}.pt"))


def _save_while_peer_dies(rank: int, port: int, ckpt: str, result: "mp.Queue") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    checkpoint.save(FileWritingEngine(rank), ckpt, 2, CheckpointState(step=2, world_size=2), World(rank, rank, 2), keep_last=2)
    if rank == 1:
        os._exit(0)  # the first complete save is done; the next one loses this rank before its barrier
    try:
        start = time.monotonic()
        checkpoint.save(FileWritingEngine(rank), ckpt, 4, CheckpointState(step=4, world_size=2), World(rank, rank, 2), keep_last=2)
        result.put(("saved", 0.0))
    except RuntimeError as err:
        result.put((str(err).splitlines()[0][:200], time.monotonic() - start))


def test_a_peer_dying_inside_a_save_leaves_no_marker(tmp_path):
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_save_while_peer_dies, args=(r, port, str(tmp_path), result)) for r in (0, 1)]
    for p in procs:
        p.start()
    outcome, seconds = result.get(timeout=120)
    for p in procs:
        p.join(timeout=30)
    assert outcome != "saved" and seconds < 30, outcome  # the barrier failed fast instead of hanging
    assert (tmp_path / "step_000004" / "states_rank0.pt").is_file()
    assert naming(checkpoint.check_complete(tmp_path / "step_000004"), "no completion marker", "interrupted")
    assert checkpoint.find_resumable(tmp_path)[0] == "step_000002"
