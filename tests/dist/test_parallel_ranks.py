"""bigtrain.parallel on 2 ranks (one launch of tests/dist_scripts/models_dist_checks.py): activation
checkpointing configured through DeepSpeed, the pipeline form under DeepSpeed (2 stages, tied embedding), and
GPT-2 built inside zero.Init (the checks in one process: tests/unit/test_parallel.py)."""
from __future__ import annotations

import json
import pathlib

import pytest

from launch import REPO, launch_ranks, rank_env

SCRIPTS = REPO / "tests" / "dist_scripts"


def launch(script: str, *args: str, timeout: int = 240) -> None:
    """Two real ranks (tests/launch.py: launch_ranks); fail with the tail of their output."""
    proc = launch_ranks(SCRIPTS / script, list(args), 2, env=rank_env(PYTHONPATH=str(REPO)), timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


def read_ranks(out: pathlib.Path) -> list[dict]:
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["rank"] for r in reports] == [0, 1]
    return reports


@pytest.fixture(scope="module")
def dist_reports(tmp_path_factory) -> list[dict]:
    """One 2-rank launch of tests/dist_scripts/models_dist_checks.py; its per-rank reports."""
    out = tmp_path_factory.mktemp("models_dist")
    launch("models_dist_checks.py", str(out))
    return read_ranks(out)


def test_activation_checkpointing_with_configured_deepspeed(dist_reports):
    """`deepspeed.checkpointing.configure`d from a DeepSpeed config (partitioned activations on CPU)."""
    for rank_report in dist_reports:
        report = rank_report["checkpointing"]
        assert sorted(report) == ["encoder", "gpt2", "resnet"]
        for family, r in report.items():
            assert r["partition_activations"] and r["blocks"] >= 2 and r["loss"] > 0.1, family
            assert r["loss_diff"] <= 1e-6 and r["grad_diff"] <= 1e-6 and r["buffer_diff"] == 0.0, (family, r)


def test_two_stage_pipeline_matches_plain_gpt2_and_keeps_embedding_tied(dist_reports):
    reports = [r["pipeline"] for r in dist_reports]
    for rank, report in enumerate(reports):
        for interval, run in report["runs"].items():
            assert run["stage"] == rank and run["parts"] == [0, 4, 8]
            # Same loss as the plain module on the same two micro-batches ...
            assert abs(run["eval_loss"] - report["reference_loss"]) <= 1e-6
            assert abs(run["train_loss"] - report["reference_loss"]) <= 1e-6
            # ... and after one SGD step every weight this stage holds equals the plain
            # module's; the tied embedding, on both stages, moved by the gradient of both uses.
            assert run["has_tied_wte"] and {"transformer.wte.weight", "lm_head.weight"} <= set(run["names"])
            assert run["max_weight_diff"] <= 1e-6 and run["start_diff"] > 1e-3
            assert run["checkpointed_segments"] == (2 if interval == "1" else 0)
    assert "transformer.wpe.weight" in reports[0]["runs"]["0"]["names"]
    assert "transformer.ln_f.weight" in reports[1]["runs"]["0"]["names"]


def test_zero3_init_builds_gpt2_partitioned_across_two_ranks(dist_reports):
    reports = [r["zero3"] for r in dist_reports]
    for kind in ("fresh", "pretrained"):
        per_rank = [r[kind] for r in reports]
        for r in per_rank:
            total = r["total_numel"]
            assert total == reports[0]["num_params"]  # all parameters, tied ones once
            # Each rank holds half (shards are padded by at most one element per tensor).
            assert total / 2 <= r["local_numel"] <= total / 2 + r["num_tensors"]
            assert r["max_local_param_numel"] == 0  # no rank ever held a full tensor after init
            assert r["tied"]
            assert abs(r["wte_std"] - 0.02) < 0.001  # transformers' init ran on the gathered shards
            assert abs(r["c_proj_std"] - 0.02 / 2) < 0.001  # incl. the 1/sqrt(2L) residual scaling
        assert per_rank[0]["checksum"] == per_rank[1]["checksum"]  # both ranks see one model
    for r in reports:
        loaded = r["pretrained"]
        assert loaded["max_abs_diff_vs_saved"] == 0.0
        assert abs(loaded["engine_loss"] - loaded["reference_loss"]) <= 1e-6
        # Activation checkpointing around ZeRO-3 blocks: same losses, the 2nd after an AdamW step.
        plain, ckpt = loaded["train_losses"], loaded["train_losses_checkpointed"]
        assert plain[1] < plain[0] and max(abs(a - b) for a, b in zip(plain, ckpt)) <= 1e-5
