"""Failures: a SIGKILLed rank ends the job within 60 s with a line naming it; the last complete
checkpoint resumes; a partial or corrupt checkpoint is detected and the previous good one used."""
from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import re
import signal
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from bigtrain.checkpoint import store as checkpoint
from bigtrain.checkpoint.state import CheckpointState
from bigtrain.distributed.world import World
from launch import REPO, TINY, deepspeed_cmd, free_port, rank_env, run_train, summary

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
    line = next((l for l in log.splitlines() if l.startswith("bigtrain: ")), "")
    assert re.search(rf"rank {victim} \(pid {pid} on \S+\) is gone \(killed or crashed\)", line), log[-4000:]
    assert f"rank {survivor} (pid" in line and "--resume" in line, line


@pytest.mark.dist
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
    proc = run_train(out, [*KILL_ARGS[len(TINY):], "--resume", "--stop-after", str(step)])
    log = proc.stdout + proc.stderr
    assert f"skipping checkpoint {ckpt / newest}: {victim_file.name} is truncated or corrupt" in log, log[-3000:]
    assert f"resumed from {ckpt / checkpoint.tag_for(step - 2)} at step {step - 2}" in log, log[-3000:]
    resumed = summary(out)
    assert resumed["steps"] == step and len(resumed["losses"]) == step
    # Steps step-1 and step, recomputed from step-2, equal what the killed run logged for them.
    assert max(abs(a - b) for a, b in zip(resumed["losses"][-2:], state.losses[-2:])) <= 1e-6, (resumed, state)


@pytest.mark.dist
def test_sigkill_of_rank_0_is_named_by_rank_1(tmp_path):
    log, seconds, code, pid = start_and_kill(tmp_path / "run", victim=0, after_step=3)
    assert code != 0 and seconds < 60, (code, seconds, log[-3000:])
    assert_named(log, victim=0, pid=pid)


# --- checkpoint completeness, without training --------------------------------------------------

def write_tag(ckpt: Path, step: int, world: int = 2) -> Path:
    tag = ckpt / checkpoint.tag_for(step)
    tag.mkdir(parents=True)
    torch.save({"w": torch.arange(1000.0) * step}, tag / "mp_rank_00_model_states.pt")
    for rank in range(world):
        torch.save({"rank": rank}, tag / f"rng_rank{rank}.pt")
    checkpoint.write_marker(tag, CheckpointState(step=step, world_size=world))
    return tag


def test_marker_records_every_file_and_a_whole_rewrite_still_counts(tmp_path):
    tag = write_tag(tmp_path, 4)
    marker = json.loads((tag / checkpoint.MARKER).read_text())
    assert marker["step"] == 4 and set(marker[checkpoint.MANIFEST]) == {
        "mp_rank_00_model_states.pt", "rng_rank0.pt", "rng_rank1.pt"}
    sizes = marker[checkpoint.MANIFEST]
    assert sizes["mp_rank_00_model_states.pt"] == (tag / "mp_rank_00_model_states.pt").stat().st_size
    assert checkpoint.check_complete(tag) is None
    torch.save({"w": torch.arange(10.0).bfloat16()}, tag / "mp_rank_00_model_states.pt")  # e.g. converted to bf16
    assert checkpoint.check_complete(tag) is None


@pytest.mark.parametrize("damage, expected", [
    (lambda tag: (tag / "mp_rank_00_model_states.pt").open("r+b").truncate(100),
     r"mp_rank_00_model_states.pt is truncated or corrupt \(not a complete torch file: 100 bytes, \d+ when "
     r"it was saved\)"),
    (lambda tag: (tag / "rng_rank0.pt").write_bytes(b""), r"rng_rank0.pt is empty"),
    (lambda tag: (tag / "rng_rank1.pt").unlink(), r"missing rng_rank1.pt"),
    (lambda tag: (tag / checkpoint.MARKER).unlink(), r"no completion marker"),
    (lambda tag: (tag / checkpoint.MARKER).write_text('{"step": 6, "wor'), r"marker is not valid JSON"),
], ids=["truncated", "empty", "deleted", "no-marker", "bad-marker"])
def test_a_damaged_checkpoint_is_skipped_for_the_previous_good_one(tmp_path, caplog, damage, expected):
    write_tag(tmp_path, 4)
    newest = write_tag(tmp_path, 6)
    damage(newest)
    assert re.search(expected, checkpoint.check_complete(newest))
    with caplog.at_level(logging.WARNING, logger="bigtrain"):
        tag, state = checkpoint.find_resumable(tmp_path)
    assert tag == "step_000004" and state.step == 4
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith(f"skipping checkpoint {newest}: ") and re.search(expected, warning)


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


@pytest.mark.dist  # spawns two ranks (gloo)
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
    assert checkpoint.check_complete(tmp_path / "step_000004") == "no completion marker (the save was interrupted)"
    assert checkpoint.find_resumable(tmp_path)[0] == "step_000002"


def test_prune_keeps_the_newest_complete_ones_and_drops_their_conversions(tmp_path):
    for step in (2, 4, 6, 8):
        write_tag(tmp_path, step)
    (tmp_path / "step_000002_universal").mkdir()  # a resume at another shape converted this one
    (tmp_path / "step_000008" / checkpoint.MARKER).unlink()  # the newest save was interrupted
    checkpoint._prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000004", "step_000006", "step_000008"]


def test_a_stale_op_build_lock_is_removed_a_fresh_one_kept(tmp_path, monkeypatch):
    """A killed JIT build of DeepSpeed's CPU ops leaves torch's lock file behind; every later rank would
    wait on it forever at start-up (seen here: a killed build's `deepspeed_shm_comm/lock` hung all jobs)."""
    from bigtrain.distributed.world import clear_stale_build_locks
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale, fresh = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock", tmp_path / "cpu_adam" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir(parents=True)
        lock.touch()
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    assert clear_stale_build_locks() == [str(stale)]
    assert not stale.exists() and fresh.exists()
