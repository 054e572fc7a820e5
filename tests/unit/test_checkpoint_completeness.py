"""Checkpoint completeness without training: the marker records every file and a whole rewrite still
counts, a damaged checkpoint (truncated, empty, deleted file, no or bad marker) is skipped for the previous
good one, pruning keeps the newest complete ones, and a stale op-build lock is removed (failures of real
ranks: tests/dist/test_failures.py)."""
from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path

import pytest
import torch

from bigtrain.checkpoint import store as checkpoint
from bigtrain.checkpoint.state import CheckpointState


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
    from bigtrain.distributed.op_locks import clear_stale_build_locks
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale, fresh = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock", tmp_path / "cpu_adam" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir(parents=True)
        lock.touch()
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    assert clear_stale_build_locks() == [str(stale)]
    assert not stale.exists() and fresh.exists()
