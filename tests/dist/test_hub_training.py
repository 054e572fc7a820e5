"""Training from a model by its Hub name, on 2 ranks, against a Hub served in the test (tests/local_hub.py) through
huggingface_hub's real download path: both ranks train on one commit that one process downloaded; the branch then
moves, and the run resumed from its checkpoint stays on the commit it started from while a new run takes the new
one; `bigtrain export` of the resumed run fetches its commit again when the cache lost it. One launch of three jobs.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launch import BIN, REPO, launch_jobs, rank_env
from local_hub import FakeHub, Repo, directory_files

COMMON = ["--model", "hf", "--set", "model.pretrained=org/tiny", "--set", "precision=fp32",
          "--set", "logging.progress_bar=false", "--set", "train.sample_tokens=0", "--peak-tflops", "1",
          "--set", "zero.stage=3", "--set", "data.seq_len=32", "--set", "batch.micro_batch=2",
          "--set", "batch.global_batch=4", "--set", "data.num_proc=1", "--set", "train.eval_interval=0",
          "--set", "train.eval_batches=0", "--set", "logging.interval=1"]


@pytest.fixture(scope="module")
def hub_runs(tmp_path_factory):
    """(root, server, repo, first commit, second commit): the three jobs run; main moves during the first."""
    from transformers import AutoModelForCausalLM

    from local_chat import make_chat_tokenizer
    from local_hf import decoder_config
    root = tmp_path_factory.mktemp("hub_runs")
    tiny = root / "tiny"
    tok = make_chat_tokenizer(tiny)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(decoder_config("llama", len(tok))).save_pretrained(tiny)
    files = directory_files(tiny)
    moved = {**files, "config.json": files["config.json"].replace(b'"rms_norm_eps": 1e-06', b'"rms_norm_eps": 1e-05')}
    assert moved != files
    (root / "corpus.txt").write_text("the cat sat on a mat and we ask what is two plus two. " * 200)
    with FakeHub() as server:
        repo = Repo()
        first = repo.push(files)
        server.repos["org/tiny"] = repo
        second: list[str] = []

        def move_main(request: str) -> None:  # once the first job has fetched its files, main moves on
            if not second and request.startswith("GET ") and f"resolve/{first}/model.safetensors" in request:
                second.append(repo.push(moved))

        server.on_request = move_main
        data = ["--data", str(root / "corpus.txt")]
        jobs = [{"name": "first", "args": [*COMMON, *data, "--steps", "2"]},
                {"name": "resumed", "copy_from": "first", "args": [*COMMON, *data, "--steps", "4", "--resume"]},
                {"name": "fresh", "args": [*COMMON, *data, "--steps", "2"]}]
        launch_jobs(root, jobs, name="hub", HF_ENDPOINT=server.endpoint, HF_HUB_CACHE=str(root / "cache"),
                    HF_HUB_OFFLINE="0", HF_TOKEN_PATH=str(root / "no-token"))
        yield root, server, repo, first, second[0]


def summary(root: Path, name: str) -> dict:
    return json.loads((root / name / "summary.json").read_text())


def test_the_ranks_train_on_one_commit_downloaded_once(hub_runs):
    root, server, repo, first, _ = hub_runs
    record = summary(root, "first")["hub"]["model"]
    assert record == {"repo_id": "org/tiny", "revision": "main", "commit": first}
    assert summary(root, "first")["run_config"]["model"]["pretrained"] == "org/tiny"  # the name, not the cache path
    downloads = [f for f in repo.served[:len(directory_files(root / "tiny"))]]
    assert sorted(downloads) == sorted(set(downloads)) == sorted(directory_files(root / "tiny")), repo.served
    marker = json.loads(next((root / "first" / "checkpoints").glob("step_*/bigtrain.json")).read_text())
    assert marker["model_build"]["hub"]["commit"] == first
    assert marker["model_build"]["overrides"]["pretrained"].endswith(f"models--org--tiny/snapshots/{first}")


def test_a_resumed_run_keeps_its_commit_after_the_branch_moved(hub_runs):
    root, _, _, first, second = hub_runs
    resumed, fresh = summary(root, "resumed"), summary(root, "fresh")
    assert resumed["hub"]["model"]["commit"] == first and len(resumed["losses"]) == 4
    assert resumed["losses"][:2] == summary(root, "first")["losses"]
    assert fresh["hub"]["model"]["commit"] == second != first


def test_export_fetches_the_runs_commit_again_where_the_cache_lost_it(hub_runs, tmp_path):
    root, server, repo, first, _ = hub_runs
    cache = root / "cache"
    shutil.rmtree(cache / "models--org--tiny")  # a cleaned cache, or another machine
    served = len(repo.served)
    env = {**rank_env(), "HF_ENDPOINT": server.endpoint, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "0",
           "HF_TOKEN_PATH": str(root / "no-token"), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([str(BIN / "bigtrain"), "export", str(root / "resumed"), "--out", str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "model.safetensors" in repo.served[served:]  # fetched again, at the run's commit
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["rms_norm_eps"] == 1e-6  # the first commit's config, not main's now
    assert (Path(tmp_path / "out") / "tokenizer.json").is_file()
