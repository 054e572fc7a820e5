"""Resuming at another shape: a checkpoint saved at 2 ranks continues at 1 rank, or at another
ZeRO stage, through DeepSpeed's universal checkpoint (bigtrain/universal.py), on the curve of
the uninterrupted run within 1e-4 relative.

Tiny GPT-2, fp32, 10 steps, saved after 5. The global batch stays 8: micro 4 x accum 1 x dp 2
at two ranks, micro 4 x accum 2 x dp 1 at one. The sampler continues one global order, so step
6 at one rank takes the same 8 samples as step 6 at two (checked in tests/unit/test_resume_shape.py,
with which shape changes need a conversion).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from launch import launch_jobs
from messages import naming

STEPS, SPLIT, RTOL = 10, 5, 1e-4
COMMON = ["--size", "tiny", "--set", "data.vocab_size=512", "--set", "data.seq_len=64", "--set", "precision=fp32",
          "--set", "logging.progress_bar=false", "--set", "train.sample_tokens=0", "--peak-tflops", "1",
          "--steps", str(STEPS), "--set", "train.eval_interval=0", "--set", "train.eval_batches=0",
          "--set", "batch.global_batch=8", "--set", "batch.micro_batch=4"]


EVAL = ("--set", f"train.eval_interval={SPLIT}", "--set", "train.eval_batches=1", "--set", "logging.interval=1")


def job(name: str, stage: int, *extra: str, copy_from: str | None = None, expect_error: bool = False) -> dict:
    return {"name": name, "args": [*COMMON, "--set", f"zero.stage={stage}", *extra], "copy_from": copy_from,
            "expect_error": expect_error}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, str]:
    """(ROOT, log of both launches): uninterrupted and split runs at 2 ranks, then resumes."""
    root = tmp_path_factory.mktemp("reshape")
    stop = ("--stop-after", str(SPLIT))
    two_ranks = [job("full2", 2), job("split2", 2, *stop), job("to_zero3", 3, "--resume", copy_from="split2"),
                 job("to_offload", 2, "--set", "offload.optimizer=cpu", "--resume", copy_from="split2"),
                 job("full3", 3, *EVAL), job("split3", 3, *EVAL, *stop),
                 job("resume3", 3, *EVAL, "--resume", copy_from="split3"),
                 job("full0", 0), job("split0", 0, *stop)]
    one_rank = [job("to_one_rank", 2, "--resume", copy_from="split2"),
                job("zero3_to_one_rank", 2, "--resume", copy_from="split3"),
                job("zero0_to_one_rank", 0, "--resume", copy_from="split0"),
                job("zero0_to_zero2", 2, "--resume", copy_from="split0", expect_error=True)]
    log = launch_jobs(root, two_ranks, num_ranks=2, name="two_ranks")
    log += launch_jobs(root, one_rank, num_ranks=1, name="one_rank")
    return root, log


def summary(root: Path, name: str) -> dict:
    return json.loads((root / name / "summary.json").read_text())


@pytest.mark.parametrize("resumed, reference, split", [
    ("to_one_rank", "full2", "split2"),  # 2 ranks ZeRO-2 -> 1 rank ZeRO-2
    ("to_zero3", "full2", "split2"),  # 2 ranks ZeRO-2 -> 2 ranks ZeRO-3
    ("to_offload", "full2", "split2"),  # torch AdamW -> DeepSpeedCPUAdam (optimizer offload)
    ("zero3_to_one_rank", "full3", "split3"),  # 2 ranks ZeRO-3 -> 1 rank ZeRO-2
    ("zero0_to_one_rank", "full0", "split0"),  # ZeRO-0: any world size loads it as it is
])
def test_resume_at_another_shape_continues_the_curve(runs, resumed, reference, split):
    root, _ = runs
    full, before, after = (summary(root, n)["losses"] for n in (reference, split, resumed))
    assert len(full) == len(after) == STEPS and len(before) == SPLIT
    assert after[:SPLIT] == before  # the history comes from the checkpoint
    worst = max(abs(a - b) / abs(b) for a, b in zip(after[SPLIT:], full[SPLIT:]))
    assert worst <= RTOL, (after, full)
    assert full[-1] < full[0] - 0.01  # a curve that moves


def test_resume_at_the_same_shape_continues_exactly_without_a_conversion(runs):
    """ZeRO-3 at 2 ranks, stopped by --stop-after and resumed by --resume at the same shape: DeepSpeed's own
    checkpoint, loaded as it is, gives the uninterrupted run's losses (in a new process: test_multinode)."""
    root, log = runs
    full, before, after = (summary(root, n) for n in ("full3", "split3", "resume3"))
    assert before["steps"] == SPLIT and before["stopped_by"] == "stop_after"
    assert after["steps"] == STEPS and after["losses"][:SPLIT] == before["losses"]
    assert max(abs(a - b) for a, b in zip(full["losses"], after["losses"])) <= 1e-6, (full, after)
    # the curves the checkpoint carries: the evaluation before the stop, the CSV files without repeated rows
    assert [s for s, _ in after["val_losses"]] == [SPLIT, STEPS] == [s for s, _ in full["val_losses"]]
    assert after["val_losses"][0] == before["val_losses"][0] and after["rates_from_step"] == SPLIT + 1
    assert after["wall_s"] > before["wall_s"] * 0.5  # the whole run's, not this process's alone
    rows = (root / "resume3" / "csv" / "train" / "bigtrain_loss.csv").read_text().splitlines()
    assert rows[0] == "step,loss" and [int(r.split(",")[0]) for r in rows[1:]] == list(range(1, STEPS + 1)), rows
    # DeepSpeed's own file counts samples, not steps: the rows before the stop stay, as in the uninterrupted run
    ours, theirs = ((root / name / "csv" / "train" / "Train_Samples_lr.csv").read_text() for name in ("resume3", "full3"))
    assert ours == theirs, (ours, theirs)
    assert not (root / "resume3" / "checkpoints" / "step_000005_universal").exists()
    assert naming(log, "resumed from", str(root / "resume3" / "checkpoints" / "step_000005"), "step 5", "RNG restored")


def test_resume_at_one_rank_keeps_the_global_batch_and_saves_at_the_new_shape(runs):
    root, _ = runs
    ds = summary(root, "to_one_rank")["ds_config"]
    triple = (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"])
    assert triple == (8, 4, 2)
    assert "checkpoint" not in ds  # load_universal is for loading only, not recorded as the run's config
    marker = json.loads((root / "to_one_rank" / "checkpoints" / "step_000010" / "bigtrain.json").read_text())
    assert marker["world_size"] == 1 and marker["step"] == STEPS
    zero3 = root / "to_zero3" / "checkpoints" / "step_000010"
    assert sorted(p.name for p in zero3.glob("zero_pp_rank_*_optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]


def test_conversion_is_logged_in_one_line(runs):
    root, log = runs
    for name, saved, now in [("to_one_rank", "world size 2 / ZeRO-2", "world size 1 / ZeRO-2"),
                             ("to_zero3", "world size 2 / ZeRO-2", "world size 2 / ZeRO-3"),
                             ("to_offload", "world size 2 / ZeRO-2", "world size 2 / ZeRO-2 / optimizer offload cpu"),
                             ("zero3_to_one_rank", "world size 2 / ZeRO-3", "world size 1 / ZeRO-2")]:
        universal = root / name / "checkpoints" / "step_000005_universal"
        # one line: the shape it was saved at, this job's, and the universal checkpoint made
        assert naming(log, f"saved at {saved}", f"job is {now}", "converted", str(universal)), log[-5000:]
        assert (universal / "bigtrain_universal.json").is_file()
    assert not (root / "zero0_to_one_rank" / "checkpoints" / "step_000005_universal").exists()
    to_zero3 = root / "to_zero3" / "checkpoints" / "step_000005_universal"
    assert naming(log, "resumed from", str(to_zero3), "step 5", "RNG restored"), log[-5000:]
    zero0 = root / "zero0_to_one_rank" / "checkpoints" / "step_000005"
    assert naming(log, "resumed from", str(zero0), "step 5", "RNG re-seeded"), log[-5000:]


def test_zero0_checkpoint_at_zero2_fails_with_the_fix(runs):
    root, _ = runs
    message = (root / "zero0_to_zero2" / "error.txt").read_text()
    assert "saved with ZeRO-0" in message and "resume with zero.stage=0" in message
    assert not (root / "zero0_to_zero2" / "summary.json").exists()


def test_conversion_happens_once_and_is_redone_for_a_rewritten_checkpoint(runs, tmp_path):
    from bigtrain.checkpoint.universal import convert_to_universal

    root, _ = runs
    ckpt = tmp_path / "checkpoints"
    shutil.copytree(root / "split2" / "checkpoints", ckpt)
    (ckpt / "step_000001_universal").mkdir()  # an orphan: its checkpoint was pruned
    path, reused = convert_to_universal(ckpt, "step_000005")
    assert (path, reused) == (ckpt / "step_000005_universal", False)
    assert not (ckpt / "step_000001_universal").exists()
    assert (ckpt / "latest_universal").read_text() == "step_000005_universal"
    # Loadable by both families of ZeRO engines, whichever saved it.
    assert (path / "mp_rank_00_model_states.pt").is_file()
    assert (path / "zero_pp_rank_0_mp_rank_00_model_states.pt").is_file()
    assert (path / "zero" / "transformer.wte.weight" / "step.pt").is_file()
    stamp = os.stat(path / "zero" / "transformer.wte.weight" / "fp32.pt").st_mtime_ns
    assert convert_to_universal(ckpt, "step_000005") == (path, True)
    assert os.stat(path / "zero" / "transformer.wte.weight" / "fp32.pt").st_mtime_ns == stamp
    marker = ckpt / "step_000005" / "bigtrain.json"
    marker.write_text(marker.read_text().replace('"step": 5', '"step": 5 '))  # a new save of the same step
    assert convert_to_universal(ckpt, "step_000005") == (path, False)
