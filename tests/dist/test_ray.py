"""bigtrain on Ray: Ray Train workers against a launcher's run, a worker killed mid-run, a Tune sweep
(the Ray verbs without a cluster: tests/unit/test_ray_cli.py).

One local Ray cluster serves the whole module (starting one costs seconds on 2 cores); it is shut
down at the end and the test checks that none of its processes is left behind.
"""
import json
import math
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from launch import REPO, TINY, launch_ranks, rank_env, summary

STEPS = 6
# GPT-2 tiny, ZeRO-2, fp32 (TINY); a checkpoint every 3 steps, per-step log events (Ray reports).
COMMON = ["--steps", str(STEPS), "--set", "zero.stage=2", "--set", "logging.interval=1",
          "--set", "train.eval_interval=0", "--set", "train.eval_batches=2", "--set", "checkpoint.interval=3"]
RANK_ENV = {"OMP_NUM_THREADS": "1", "DEEPSPEED_TIMEOUT": "2", "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            # Ray Train helpers a one-machine test does not need (each would be one more process), and
            # room for a slow start on a busy 2-core machine (the default gives a worker group 60 s).
            "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "RAY_TRAIN_METRICS_ENABLED": "0",
            "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "300",
            # Ray Train's controller learns that a worker died or that the group finished at its next poll of
            # the workers (every 2 s by default): three such waits (the kill, each attempt's end) shrink to ~0.5 s.
            "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}
RAY_PROCESSES = ("raylet", "gcs_server", "ray::")


def ray_children() -> list[str]:
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            text = " ".join(proc.cmdline()[:2]) or proc.name()
        except psutil.Error:
            continue
        if any(name in text for name in RAY_PROCESSES) or "ray/_private" in text or "ray/dashboard" in text:
            found.append(f"{proc.pid} {text[:120]}")
    return found


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster for the module: a small object store, no dashboard, and 4 logical CPUs
    on this 2-core host so that the Tune sweep (2 trials at a time) runs beside the 2 Ray Train
    workers. The workers inherit this process's environment as it is when the cluster starts."""
    from bigtrain.launch.ray_train import connect
    saved = {key: os.environ.get(key) for key in RANK_ENV}
    os.environ.update(RANK_ENV)
    import ray
    assert connect(None, num_cpus=4, object_store_mb=128)
    try:
        yield ray
    finally:
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        deadline = time.time() + 20
        while ray_children() and time.time() < deadline:
            time.sleep(0.5)
        assert not ray_children(), f"Ray processes left running: {ray_children()}"


@pytest.fixture(scope="module")
def launcher_run(tmp_path_factory):
    """The same job on 2 ranks started as torchrun starts them (tests/launch.py: launch_ranks), the reference for the
    Ray run (a launcher's ranks, uninterrupted; the ranks, their process group and engine are DeepSpeed's launcher's,
    and the launcher is not what this compares). It runs in the background
    while the Ray cluster starts and the Ray jobs run: on 2 cores each of them spends much of its time starting
    processes one after another, and together they keep both cores busy."""
    out = tmp_path_factory.mktemp("launcher") / "run"

    def run() -> dict:
        proc = launch_ranks(REPO / "bigtrain" / "run.py", ["--out", str(out), *TINY, *COMMON], 2, env=rank_env(),
                            timeout=300)
        assert proc.returncode == 0, f"training failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}"
        return summary(out)
    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(run)


# Trials are throw-away runs: no checkpoint at their end (the sweep reads their reports and summary.json).
TUNE_ARGS = [*TINY, "--steps", "5", "--set", "train.eval_interval=1", "--set", "train.eval_batches=1",
             "--set", "logging.interval=1", "--set", "schedule.warmup_steps=1", "--set", "checkpoint.at_end=false"]


@pytest.fixture(scope="module")
def tune_run(ray_cluster, tmp_path_factory):
    """A 3-trial Tune sweep of 5-step jobs, 2 trials at a time, in the background (Tune may run in a
    thread; Ray Train's fit installs a signal handler and needs the main thread). The third trial waits for a
    slot: were the cap on concurrent trials lost, Tune would reserve 3 of the cluster's 4 CPUs up front and the
    Ray Train job's 2 workers could not start."""
    from bigtrain.launch.tune import TuneSpace, tune_sweep
    out = tmp_path_factory.mktemp("tune") / "sweep"
    space = TuneSpace(lr=(1e-4, 1e-2), micro_batches=(2, 4), trials=3, seed=0)
    with ThreadPoolExecutor(1) as pool:
        yield out, pool.submit(tune_sweep, ["--out", str(out), *TUNE_ARGS], space, max_concurrent=2)


@pytest.fixture(scope="module")
def ray_run(launcher_run, tune_run, ray_cluster, tmp_path_factory):
    """One Ray Train job on 2 workers that goes through a worker failure: rank 1 dies after step 5
    of the first attempt (the last checkpoint is step 3), Ray restarts the group (max_failures=1)
    and the new workers resume from step 3. Steps 1-3 of its summary come from the first attempt,
    4-6 from the second: one run (~60 CPU-s on 2 cores) checks both, within the suite's budget."""
    from bigtrain.launch.ray_train import TEST_EXIT_ENV, train_on_ray
    out = tmp_path_factory.mktemp("ray") / "run"
    result = train_on_ray(["--out", str(out), *TINY, *COMMON], num_workers=2, max_failures=1,
                          env={TEST_EXIT_ENV: "1:5"})
    return out, result


@pytest.fixture
def launcher_losses(launcher_run):
    s = launcher_run.result(timeout=600)
    assert len(s["losses"]) == STEPS and s["world_size"] == 2
    return s["losses"]


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) for x, y in zip(a, b))


def test_the_driver_keeps_bigtrain_warnings(ray_cluster):
    """Ray's logging config sets the driver's root logger to ERROR; bigtrain's own lines on the driver keep their
    level (they once went silent there, and every later test in that process lost them)."""
    import logging
    assert logging.getLogger("bigtrain").isEnabledFor(logging.WARNING)


def test_ray_train_workers_match_a_launchers_run(ray_run, launcher_losses):
    from bigtrain.checkpoint.store import check_complete
    from bigtrain.launch.ray_train import read_pointer
    out, result = ray_run
    assert result.error is None
    s = summary(out)
    assert s["world_size"] == 2 and s["steps"] == STEPS and s["stopped_by"] == ""
    assert s["ds_config"]["zero_optimization"]["stage"] == 2
    print(f"\nRay Train vs launcher: max |loss diff| {max_diff(s['losses'], launcher_losses):.2e} over {STEPS} steps")
    assert max_diff(s["losses"], launcher_losses) <= 1e-5, (s["losses"], launcher_losses)
    assert s["losses"][0] != s["losses"][-1]
    # Ray got rank 0's metrics each log step, and bigtrain's last checkpoint as its own.
    assert result.metrics["step"] == STEPS and abs(result.metrics["loss"] - s["losses"][-1]) < 1e-12
    tag = read_pointer(result.checkpoint)
    assert tag == (out / "checkpoints" / f"step_{STEPS:06d}").resolve() and check_complete(tag) is None
    assert Path(result.path).is_relative_to((out / "ray").resolve())


def test_a_killed_worker_restarts_from_the_last_checkpoint(ray_run, launcher_losses):
    out, result = ray_run
    assert result.error is None
    killed = out / "test_exit_rank1_step5"
    assert killed.is_file(), "the worker was never killed"
    ckpt = out / "checkpoints"
    # Resumed from step 3, not restarted from scratch: step 3's checkpoint predates the kill, step 6's follows it.
    assert (ckpt / "step_000003" / "bigtrain.json").stat().st_mtime < killed.stat().st_mtime
    assert (ckpt / "step_000006" / "bigtrain.json").stat().st_mtime > killed.stat().st_mtime
    s = summary(out)
    assert s["steps"] == STEPS and s["stopped_by"] == ""
    after = max_diff(s["losses"][3:], launcher_losses[3:])
    print(f"\nkilled after step 5, resumed at 3: max |loss diff| of steps 4-6 vs uninterrupted {after:.2e}")
    assert after <= 1e-5, (s["losses"], launcher_losses)


def test_tune_sweep_reports_the_best_config(tune_run, capsys):
    from bigtrain.launch.tune import print_outcome
    out, future = tune_run
    result = future.result(timeout=900)
    assert len(result.rows) == 3 and not any(row["error"] for row in result.rows)
    assert all(1 <= row["step"] <= 5 and math.isfinite(row["val_loss"]) for row in result.rows)
    finished = [row for row in result.rows if row["step"] == 5]
    assert finished and result.best_step == 5
    assert result.best_val_loss == min(row["val_loss"] for row in finished)
    lr, batch = result.best["optimizer.lr"], result.best["batch.micro_batch"]
    assert 1e-4 <= lr <= 1e-2 and batch in (2, 4)
    assert result.set_line == f"--set optimizer.lr={lr} --set batch.micro_batch={batch}"
    # the best trial ran to its end: its own summary.json says the same
    trial_summaries = [json.loads(p.read_text()) for p in (out / "trials").glob("*/summary.json")]
    best = [s for s in trial_summaries if s["run_config"]["optimizer"]["lr"] == lr
            and s["run_config"]["batch"]["micro_batch"] == batch and s["steps"] == 5]
    assert best and abs(best[0]["val_losses"][-1][1] - result.best_val_loss) < 1e-9
    print_outcome(result)
    printed = capsys.readouterr().out
    assert printed.strip().splitlines()[-1] == result.set_line
    assert re.search(r"best: val_loss \d+\.\d{4} at step 5", printed)
