"""The runner through the real launchers: learning (through torchrun, the launch the torchrun journey checks),
SIGTERM through DeepSpeed's launcher, launch modes (exact resume: test_reshape_resume, test_multinode, test_ray)."""
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch import REPO, TINY, deepspeed_cmd, free_port, launch_ranks, rank_env, run_train, summary
from messages import naming

TORCHRUN = Path(sys.executable).parent / "torchrun"


def write_corpus(path: Path) -> Path:
    """A local text file with learnable structure (real sentences, repeated with variations)."""
    subjects = ["The model", "A rank", "The optimizer", "Each stage", "The checkpoint", "DeepSpeed"]
    verbs = ["saves", "loads", "shards", "gathers", "updates", "reduces"]
    objects = ["the gradients.", "its parameters.", "the optimizer state.", "a new batch.", "the loss."]
    lines = [f"{s} {v} {o}" for i, s in enumerate(subjects) for j, v in enumerate(verbs) for o in objects[(i + j) % 5:]]
    path.write_text("\n".join(lines * 6) + "\n")
    return path


@pytest.fixture(scope="module")
def torchrun_on_local_text(tmp_path_factory) -> Path:
    """`torchrun --nproc_per_node 2 bigtrain/run.py`, as a user starts it, training 40 steps on a local text file:
    one launch for the torchrun journey and the learning one (each launch costs ~15 CPU s before its first step)."""
    root = tmp_path_factory.mktemp("local_text")
    corpus, out = write_corpus(root / "corpus.txt"), root / "run"
    proc = subprocess.run([str(TORCHRUN), "--nproc_per_node", "2", "--master_port", str(free_port()), "bigtrain/run.py",
                           "--out", str(out), *TINY, "--data", str(corpus), "--steps", "40",
                           "--set", "train.eval_interval=10", "--set", "optimizer.lr=3e-3",
                           "--set", "schedule.warmup_steps=5"],
                          cwd=REPO, env=rank_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_training_on_a_local_text_file_lowers_validation_loss(torchrun_on_local_text):
    out = torchrun_on_local_text
    s = summary(out)
    vals = [v for _, v in s["val_losses"]]
    assert [step for step, _ in s["val_losses"]] == [10, 20, 30, 40]
    assert vals[-1] < vals[0] - 0.5, vals
    assert vals[-1] < math.log(512) - 2.0  # far better than uniform over the vocabulary
    assert len(s["losses"]) == 40 and s["world_size"] == 2
    for key in ("tokens_per_s", "mfu", "peak_memory_per_rank", "ds_config", "final_loss"):
        assert key in s
    assert s["ds_config"]["train_batch_size"] == 8 and len(s["peak_memory_per_rank"]) == 2
    assert (out / "tokenizer" / "tokenizer.json").is_file()
    csv_dir = out / "csv" / "train"
    assert (csv_dir / "bigtrain_loss.csv").is_file() and (csv_dir / "bigtrain_mfu.csv").is_file()


def test_sigterm_mid_run_leaves_a_checkpoint_that_resumes(tmp_path):
    out = tmp_path / "run"
    args = ["--out", str(out), *TINY, "--steps", "400", "--set", "logging.interval=1", "--set",
            "train.eval_interval=0"]
    # A session of its own, signalled as a whole, as slurm or a container runtime signals a job:
    # DeepSpeed's single-node runner does not forward SIGTERM to its launcher.
    proc = subprocess.Popen(deepspeed_cmd(REPO / "bigtrain" / "run.py", args), cwd=REPO, env=rank_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    deadline = time.time() + 180
    for line in proc.stdout:  # wait until training is under way
        lines.append(line)
        if line.startswith("step 5/400") or time.time() > deadline:
            break
    os.killpg(proc.pid, signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    log = "".join(lines) + rest
    saved = json.loads((out / "summary.json").read_text())
    assert saved["stopped_by"] == "SIGTERM" and 5 <= saved["steps"] < 400, log[-3000:]
    tag = out / "checkpoints" / f"step_{saved['steps']:06d}"
    assert (tag / "bigtrain.json").is_file(), log[-3000:]
    # The resume is about the checkpoint, not the launcher: ranks started as torchrun starts them.
    resume = launch_ranks(REPO / "bigtrain" / "run.py", ["--out", str(out), *TINY, "--steps", str(saved["steps"] + 3),
                                                         "--resume", "--set", "train.eval_interval=0"], 2,
                          env=rank_env(), timeout=300)
    assert resume.returncode == 0, resume.stdout[-3000:] + resume.stderr[-3000:]
    resumed = summary(out)
    assert resumed["steps"] == saved["steps"] + 3 and resumed["stopped_by"] == ""
    assert resumed["losses"][:saved["steps"]] == saved["losses"]


def test_plain_python_and_torchrun(tmp_path, torchrun_on_local_text):
    env = rank_env()
    one = subprocess.run([sys.executable, "bigtrain/run.py", "--out", str(tmp_path / "one"), *TINY, "--steps", "3"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    assert summary(tmp_path / "one")["world_size"] == 1
    # torchrun: the fixture's launch (exit 0 asserted there) ran 2 ranks
    assert summary(torchrun_on_local_text)["world_size"] == 2


def test_bad_config_fails_fast_with_one_line(tmp_path):
    proc = run_train(tmp_path / "bad", ["--steps", "2", "--set", "zero.stage=2", "--set", "pipeline.stages=2"],
                     check=False)
    assert proc.returncode != 0
    assert naming(proc.stdout + proc.stderr, "zero.stage=2", "2 pipeline stages", "ZeRO 0-1"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
