"""Nothing silently wrong: a diverging run stops, a used output folder never mixes two runs, a second
job on a folder is refused, a changed model is refused on resume, damaged bytes and a full disk are named, the
first step trains at the schedule's rate, and a mistake seen on one rank is one line from rank 0 only.

The pieces, without a launcher; the journeys a user takes, through the real launcher or a plain `python`, are
tests/dist/test_run_guard_journeys.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from messages import naming

from bigtrain.checkpoint import store
from bigtrain.checkpoint.claim import RunDirLock, claim_run_dir
from bigtrain.checkpoint.resume import check_same_model, model_differences
from bigtrain.checkpoint.state import CheckpointState, ModelBuild
from bigtrain.distributed.world import World
from bigtrain.train.loop import loss_problem
from bigtrain.train.report import write_summary

ONE = World(0, 0, 1)


def strict_json(path: Path) -> dict:
    def refuse(name: str):
        raise AssertionError(f"{path} holds {name}, which strict JSON parsers reject")
    return json.loads(path.read_text(), parse_constant=refuse)


def test_a_non_finite_or_exploding_loss_is_named():
    assert loss_problem(6.2, None) is None and loss_problem(6.2, 10.0) is None
    assert "nan" in loss_problem(float("nan"), None) and "inf" in loss_problem(float("inf"), None)
    assert "train.max_loss=10" in loss_problem(12.5, 10.0)


def test_summary_json_is_strict_json_with_nulls_for_nan(tmp_path):
    write_summary(tmp_path, {"losses": [6.2, float("nan"), float("inf")], "final_loss": float("nan"),
                             "val_losses": [[2, float("nan")]]})
    summary = strict_json(tmp_path / "summary.json")
    assert summary["losses"] == [6.2, None, None] and summary["final_loss"] is None
    assert summary["val_losses"] == [[2, None]]


def test_a_changed_model_is_named_and_refused(tmp_path):
    saved = ModelBuild("gpt2", "tiny", {"vocab_size": 512, "n_positions": 128, "seq_len": 64, "n_head": 2})
    same_but_longer = ModelBuild("gpt2", "tiny", {"vocab_size": 512, "n_positions": 128, "seq_len": 96, "n_head": 2})
    assert model_differences(saved, same_but_longer) == []  # the data's length is not the model
    heads = ModelBuild("gpt2", "tiny", {**saved.overrides, "n_head": 4})
    assert model_differences(saved, heads) == ["n_head 2 -> 4"]
    llama = ModelBuild("llama", "tiny", {"vocab_size": 512, "seq_len": 64})
    assert model_differences(saved, llama)[0] == "model.family gpt2 -> llama"
    state = CheckpointState(step=4, world_size=1, model_build=saved)
    with pytest.raises(ValueError, match=r"--resume: .*step_000004 trained another model \(n_head 2 -> 4\).*--out"):
        check_same_model(tmp_path / "step_000004", state, heads)
    check_same_model(tmp_path / "step_000004", state, same_but_longer)


def test_a_copied_pretrained_directory_is_the_same_model(tmp_path):
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    (tmp_path / "c" / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 4}))
    build = lambda d: ModelBuild("hf", "custom", {"pretrained": str(tmp_path / d)})  # noqa: E731
    assert model_differences(build("a"), build("b")) == []
    assert model_differences(build("a"), build("c"))[0].startswith("pretrained ")


def test_one_job_per_folder_and_no_fresh_run_on_an_earlier_runs_checkpoints(tmp_path, caplog):
    out = tmp_path / "run"
    first = claim_run_dir(out, out / "checkpoints", ONE, resume=False, overwrite=False)
    with pytest.raises(ValueError) as err:
        claim_run_dir(out, out / "checkpoints", ONE, resume=True, overwrite=False)
    assert naming(str(err.value), str(out), "in use", f"pid {os.getpid()}", "another --out"), err.value
    first.release()
    tag = out / "checkpoints" / "step_000004"
    tag.mkdir(parents=True)
    torch.save({"rank": 0}, tag / "rng_rank0.pt")
    store.write_marker(tag, CheckpointState(step=4, world_size=1))
    (out / "summary.json").write_text("{}")
    with pytest.raises(ValueError) as err:
        claim_run_dir(out, out / "checkpoints", ONE, resume=False, overwrite=False)
    # the earlier run's newest checkpoint, and the three ways on
    assert naming(str(err.value), "earlier run", "step_000004", "--resume", "another --out", "--overwrite"), err.value
    with pytest.raises(ValueError, match="give one of them"):
        claim_run_dir(out, out / "checkpoints", ONE, resume=True, overwrite=True)
    claim_run_dir(out, out / "checkpoints", ONE, resume=True, overwrite=False).release()
    claim_run_dir(out, out / "checkpoints", ONE, resume=False, overwrite=True).release()
    assert not tag.exists() and not (out / "summary.json").exists()
    (out / "checkpoints" / "step_000006").mkdir()  # a save killed before its marker: debris, not a run
    claim_run_dir(out, out / "checkpoints", ONE, resume=False, overwrite=False).release()
    assert not (out / "checkpoints" / "step_000006").exists()


def test_the_lock_goes_with_a_killed_job(tmp_path):
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from bigtrain.checkpoint.claim import RunDirLock; "
        f"assert RunDirLock().acquire(Path({str(out)!r})) is None; print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    assert f"pid {holder.pid}" in RunDirLock().acquire(out)
    holder.kill()
    holder.wait()
    lock = RunDirLock()
    assert lock.acquire(out) is None
    lock.release()


def write_tag(ckpt: Path, step: int) -> Path:
    tag = ckpt / store.tag_for(step)
    tag.mkdir(parents=True)
    torch.save({"exp_avg": torch.arange(100_000.0) * step}, tag / "optim_states.pt")
    torch.save({"rank": 0}, tag / "rng_rank0.pt")
    store.write_marker(tag, CheckpointState(step=step, world_size=1))
    return tag


def test_bytes_changed_inside_a_file_are_caught_and_the_previous_checkpoint_is_used(tmp_path, caplog):
    write_tag(tmp_path, 2)
    newest = write_tag(tmp_path, 4)
    marker = json.loads((newest / store.MARKER).read_text())
    assert set(marker["digests"]) == {"optim_states.pt", "rng_rank0.pt"}
    path = newest / "optim_states.pt"
    size = path.stat().st_size
    with path.open("r+b") as f:  # 4 KB overwritten in place: same size, still a complete zip archive
        f.seek(size // 2)
        f.write(os.urandom(4096))
    assert path.stat().st_size == size and store.check_complete(newest) is None
    with caplog.at_level("WARNING", logger="bigtrain"):
        tag, state = store.find_resumable(tmp_path)
    assert tag == "step_000002" and state.step == 2
    assert naming([r.getMessage() for r in caplog.records], str(newest), "optim_states.pt", "changed"), caplog.text


def test_a_full_disk_during_a_save_is_one_line_naming_the_kept_checkpoint(tmp_path):
    write_tag(tmp_path, 2)

    class FullDiskEngine:
        def save_checkpoint(self, save_dir: str, tag: str) -> None:
            (Path(save_dir) / tag).mkdir()
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 576 vs 470")

    with pytest.raises(store.DiskFull) as caught:
        import unittest.mock
        with unittest.mock.patch("shutil.disk_usage", return_value=SimpleNamespace(total=10**9, used=10**9, free=0)):
            store.save(FullDiskEngine(), tmp_path, 4, CheckpointState(step=4, world_size=1), ONE, keep_last=2)
    message = str(caught.value)  # the disk and its free space, the save that failed, the checkpoint kept, the fix
    assert "\n" not in message and naming(message, str(tmp_path), "full", "MB free", "step_000004"), message
    assert naming(message, "last complete checkpoint", "step_000002", "--resume"), message
    assert store.find_resumable(tmp_path)[0] == "step_000002"


def test_export_refuses_non_finite_weights():
    from bigtrain.export.write import load_into
    model = torch.nn.Linear(4, 2)
    weights = {"weight": torch.full((2, 4), float("nan")), "bias": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"non-finite weights \(weight has NaN .*--tag"):
        load_into(model, weights)


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_step_1_trains_at_the_schedules_first_rate(one_rank_group, kind):
    """AdamW's first update moves each weight by lr * g/|g| (weight decay 0): its size is the rate it used."""
    from bigtrain import models
    from bigtrain.config.load import load_run_config
    from bigtrain.ds.generate import build_ds_config
    from bigtrain.train.engine import Engine, EngineOptions
    run = load_run_config(None, ["precision=fp32", "optimizer.lr=1e-2", "optimizer.weight_decay=0",
                                 f"schedule.kind={kind}", "schedule.warmup_steps=10", "schedule.min_lr_ratio=0.1",
                                 "train.steps=50", "batch.micro_batch=2", "batch.grad_accum=1"])
    ds_config = build_ds_config(run, 1)
    ds_config["optimizer"]["params"]["torch_adam"] = True
    spec = models.build("gpt2", "tiny", vocab_size=64, n_positions=16, seq_len=16)
    engine = Engine(spec, ds_config, EngineOptions(loss_impl="plain", compile=False))
    promised = 1e-2 * 0.1  # iteration 0 of the warm-up from 10% of the peak (every kind warms up first)
    assert engine.lr() == pytest.approx(promised)
    before = {n: p.detach().clone() for n, p in engine.ds.module.named_parameters()}
    tokens = torch.randint(0, 64, (2, 17))
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    engine.train_step(iter([batch]))
    moved = max(float((p.detach() - before[n]).abs().max()) for n, p in engine.ds.module.named_parameters())
    assert moved == pytest.approx(promised, rel=0.02)
    assert engine.lr() == pytest.approx(1e-2 * (0.1 + 0.9 / 10))  # step 2's rate, next in the warm-up


def test_a_run_that_is_all_warm_up_and_a_resume_that_rebuilds_the_schedule_are_said():
    """Short runs never left warm-up without a word; a resume with more steps rebuilt the schedule silently."""
    from bigtrain.config.load import load_run_config
    from bigtrain.ds.resolve import resolve
    from bigtrain.train.job import schedule_change_line

    def notes(steps: int) -> list[str]:
        return resolve(load_run_config(None, [f"train.steps={steps}", "schedule.warmup_steps=20"]), None, 1).notes
    assert any(naming(n, "warm-up (20 steps)", "whole run (20 steps)", "schedule.warmup_steps") for n in notes(20))
    assert not any("warm-up" in n for n in notes(200))
    run = load_run_config(None, ["train.steps=30"])
    line = schedule_change_line({"train": {"steps": 20}}, run, 5.5e-4, 20)
    assert naming(line, "train.steps 20 -> 30", "step 21", "0.00055", "rebuilt"), line
    assert schedule_change_line({"train": {"steps": 30}}, run, 5.5e-4, 20) is None
