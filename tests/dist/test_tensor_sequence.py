"""Tensor x sequence parallelism: AutoTP's shards with Ulysses' head split inside each tensor shard
(bigtrain.parallel.tensor_sequence), TP2 x SP2 on 4 CPU ranks against data parallelism over the same 4 ranks (equal
to one process: tests/dist/test_parallel_modes.py), fp32, in one launch:

- ZeRO-1 and ZeRO-3 with Adam, and ZeRO-1 with SGD without clipping: Adam's update and the clipped gradient do not
  change when every gradient is scaled alike, SGD's does, so only the SGD runs see a gradient of the wrong size
  (Ulysses alone had one: twice the gradient at SP2, DeepSpeed summing the sequence group's gradients where bigtrain
  expected it to average them; `sp2_dp2_sgd` holds it);
- a TP2 x SP2 run stopped at step 2 and resumed as SP2 x DP2 (another tensor size: DeepSpeed's universal
  checkpoint), and an SP2 x DP2 run resumed as TP2 x DP2, each continuing the uninterrupted curve (DeepSpeed 0.19.8 could
  neither load a universal checkpoint into a Ulysses engine nor record an SP run's tensor size right:
  bigtrain.parallel.sequence.UlyssesGroups);
- the export of a TP2 x SP2 run (whole weights, as transformers loads them) against the export of the reference.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launch import REPO, launch_jobs, rank_env, summary

RTOL = 1e-5
STEPS = 4
COMMON = ["--model", "llama", "--size", "tiny", "--set", "data.vocab_size=512", "--set", "data.seq_len=64",
          "--set", "precision=fp32", "--set", "logging.progress_bar=false", "--set", "train.sample_tokens=0",
          "--peak-tflops", "1", "--steps", str(STEPS), "--set", "train.eval_interval=0",
          "--set", "batch.global_batch=4"]
SGD = ["--set", "optimizer.name=sgd", "--set", "optimizer.lr=2.0", "--set", "optimizer.grad_clip=0",
       "--set", "schedule.kind=constant", "--set", "schedule.warmup_steps=1"]
TP_SP = ["--set", "parallel.tensor=2", "--set", "parallel.sequence=2", "--set", "batch.micro_batch=4"]
SP_DP = ["--set", "parallel.sequence=2", "--set", "batch.micro_batch=2"]
TP_DP = ["--set", "parallel.tensor=2", "--set", "batch.micro_batch=2"]
DP = ["--set", "batch.micro_batch=1"]


def zero(stage: int) -> list[str]:
    return ["--set", f"zero.stage={stage}"]


def job(name: str, *args: str, **more) -> dict:
    return {"name": name, "args": [*COMMON, *args], **more}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tensor_sequence")
    log = launch_jobs(root, [
        job("ref", *DP, *zero(1)), job("ref_sgd", *DP, *zero(1), *SGD),
        job("tp2_sp2_z1", *TP_SP, *zero(1)), job("tp2_sp2_z3", *TP_SP, *zero(3)),
        job("tp2_sp2_sgd", *TP_SP, *zero(1), *SGD), job("sp2_dp2_sgd", *SP_DP, *zero(1), *SGD),
        job("tp2_sp2_stop", *TP_SP, *zero(1), "--stop-after", "2"),
        job("sp2_dp2_resumed", *SP_DP, *zero(1), "--resume", copy_from="tp2_sp2_stop"),
        job("sp2_dp2_stop", *SP_DP, *zero(1), "--stop-after", "2"),
        job("tp2_dp2_resumed", *TP_DP, *zero(1), "--resume", copy_from="sp2_dp2_stop")],
        num_ranks=4, name="four", timeout=900)
    (root / "four.log").write_text(log)
    return root


def worst(reference: list[float], losses: list[float]) -> float:
    assert len(reference) == len(losses) == STEPS
    return max(abs(a - b) / abs(a) for a, b in zip(reference, losses))


@pytest.mark.parametrize("name, reference", [("tp2_sp2_z1", "ref"), ("tp2_sp2_z3", "ref"),
                                             ("tp2_sp2_sgd", "ref_sgd"), ("sp2_dp2_sgd", "ref_sgd"),
                                             ("sp2_dp2_resumed", "tp2_sp2_z1"), ("tp2_dp2_resumed", "ref")])
def test_tensor_by_sequence_parallelism_trains_like_one_process(runs, name, reference):
    ran, ref = summary(runs / name), summary(runs / reference)
    margin = worst(ref["losses"], ran["losses"])
    print(f"{name} vs {reference}: worst relative loss difference {margin:.2e}")
    assert margin <= RTOL, (ref["losses"], ran["losses"])
    assert ran["ds_config"]["train_batch_size"] == ref["ds_config"]["train_batch_size"] == 4
    if name.startswith("tp2_sp2"):
        assert ran["ds_config"]["tensor_parallel"]["autotp_size"] == 2
        assert ran["run_config"]["parallel"]["sequence"] == 2


def test_the_sgd_runs_would_see_a_gradient_of_the_wrong_size(runs):
    """The SGD reference moves: a gradient twice its size would give another curve (the Adam runs could not tell)."""
    losses = summary(runs / "ref_sgd")["losses"]
    assert losses[-1] < losses[0] - 0.1, losses


def test_a_split_run_resumes_at_another_shape_through_a_universal_checkpoint(runs):
    log = (runs / "four.log").read_text()
    assert log.count("converted to a universal checkpoint") == 2, log[-3000:]
    for name, tensor in (("sp2_dp2_resumed", 1), ("tp2_dp2_resumed", 2)):
        ran = summary(runs / name)
        assert ran["ds_config"].get("tensor_parallel", {}).get("autotp_size", 1) == tensor and ran["steps"] == STEPS


def test_the_export_of_a_tensor_by_sequence_run_has_whole_weights(runs, tmp_path):
    """Exported as transformers loads it (AutoTP's shards merged, ZeRO-3's partitions gathered), the TP2 x SP2 run
    gives the reference's logits."""
    from transformers import AutoModelForCausalLM
    bigtrain = str(Path(sys.executable).parent / "bigtrain")
    for run in ("tp2_sp2_z3", "ref"):
        proc = subprocess.run([bigtrain, "export", str(runs / run), "--out", str(tmp_path / run)], cwd=REPO,
                              env=rank_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and "largest logit difference on a fixed batch 0" in proc.stdout, proc.stderr
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    split, one = (AutoModelForCausalLM.from_pretrained(tmp_path / run).eval() for run in ("tp2_sp2_z3", "ref"))
    assert sum(p.numel() for p in split.parameters()) == sum(p.numel() for p in one.parameters())
    with torch.no_grad():
        difference = float((split(ids).logits - one(ids).logits).abs().max())
    print(f"tp2_sp2_z3: export logits vs the reference's: {difference:.2e}")
    assert difference <= 1e-5
