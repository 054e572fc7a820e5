"""`bigtrain tune`: a Ray Tune sweep over learning rate and micro-batch size, with ASHA early stopping
on validation loss. Each trial is a short bigtrain job (a world of one: one GPU or a few cores) with
its own OUT directory; each evaluation is reported to Tune, and ASHA stops the trials whose
validation loss trails at each rung. The best trial's settings are printed as a `--set` line to
paste into the real run.

Ray is an optional extra: nothing here imports it at module level.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bigtrain.launch.ray_train import check_run_args, connect, require_ray

LR_KEY, BATCH_KEY = "optimizer.lr", "batch.micro_batch"


@dataclass(frozen=True)
class TuneSpace:
    """lr: (low, high) sampled log-uniformly, or a list to choose from; micro_batches: choices."""
    lr: tuple[float, float] | list[float] = (1e-4, 3e-3)
    micro_batches: tuple[int, ...] = (2, 4, 8)
    trials: int = 4
    seed: int = 0

    @staticmethod
    def parse(lr: str, micro_batches: str, trials: int, seed: int = 0) -> "TuneSpace":
        """`--lr 1e-4:3e-3` (a log-uniform range) or `--lr 3e-4,1e-3`; `--micro-batch 2,4,8`."""
        try:
            if ":" in lr:
                low, high = (float(x) for x in lr.split(":"))
                rates: Any = (low, high)
                if not 0 < low < high:
                    raise ValueError
            else:
                rates = [float(x) for x in lr.split(",")]
                if any(r <= 0 for r in rates):
                    raise ValueError
        except ValueError:
            raise ValueError(f"--lr {lr!r}: give LOW:HIGH (e.g. 1e-4:3e-3, 0 < LOW < HIGH) "
                             "or a list (3e-4,1e-3)") from None
        try:
            batches = tuple(int(x) for x in micro_batches.split(","))
            if any(b < 1 for b in batches):
                raise ValueError
        except ValueError:
            raise ValueError(f"--micro-batch {micro_batches!r}: give positive integers, e.g. 2,4,8") from None
        if trials < 1:
            raise ValueError(f"--trials is {trials}; give 1 or more")
        return TuneSpace(rates, batches, trials, seed)

    def param_space(self) -> dict:
        from ray import tune
        lr = tune.loguniform(*self.lr) if isinstance(self.lr, tuple) else tune.choice(list(self.lr))
        return {LR_KEY: lr, BATCH_KEY: tune.choice(list(self.micro_batches))}


@dataclass
class TuneOutcome:
    best: dict  # {"optimizer.lr": ..., "batch.micro_batch": ...}
    best_val_loss: float
    best_step: int
    rows: list[dict]  # one per trial: its settings, last step, last val_loss
    set_line: str
    grid: Any  # Ray Tune's ResultGrid


def round_lr(lr: float) -> float:
    """Three significant digits: what the trial trains with is exactly what the --set line says."""
    return float(f"{lr:.3g}")


def tune_sweep(run_args: list[str], space: TuneSpace, cpus_per_trial: int = 1, gpus_per_trial: float = 0,
               address: str | None = None, storage_path: str | None = None, name: str | None = None,
               max_concurrent: int | None = None) -> TuneOutcome:
    """Run the sweep; every trial is `bigtrain/run.py RUN_ARGS --set optimizer.lr=.. --set batch.micro_batch=..`
    with OUT/trials/TRIAL as its output. RUN_ARGS should make short jobs that evaluate often
    (`--steps 200 --set train.eval_interval=20`): ASHA compares trials at each evaluation.
    `max_concurrent` caps the trials running at once (default: as many as the cluster's resources allow)."""
    steps, eval_interval, out = sweep_shape(run_args, space, gpus_per_trial > 0)  # one line, with Ray or without
    require_ray()
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search.basic_variant import BasicVariantGenerator

    started = connect(address, os.cpu_count() or 1)
    storage = Path(storage_path or out / "ray")
    storage = storage if "://" in str(storage) else storage.resolve()
    job = {"run_args": list(run_args), "cwd": os.getcwd(), "trials_dir": str((out / "trials").resolve())}
    trainable = tune.with_resources(tune.with_parameters(trial_main, job=job),
                                    {"cpu": cpus_per_trial, "gpu": gpus_per_trial})
    asha = ASHAScheduler(time_attr="step", max_t=steps, grace_period=min(eval_interval, steps), reduction_factor=2)
    # The cap goes on the generator itself: Tune ignores max_concurrent_trials beside a generator, and
    # would create (and reserve resources for) every trial up front, starving other jobs on the cluster.
    sampler = BasicVariantGenerator(random_state=space.seed, max_concurrent=max_concurrent or 0)
    tuner = tune.Tuner(
        trainable,
        param_space=space.param_space(),
        tune_config=tune.TuneConfig(metric="val_loss", mode="min", num_samples=space.trials, scheduler=asha,
                                    search_alg=sampler, reuse_actors=False),
        run_config=tune.RunConfig(name=name or f"tune_{time.strftime('%Y%m%d_%H%M%S')}", storage_path=str(storage),
                                  verbose=0))
    try:
        grid = tuner.fit()
    finally:
        if started:
            import ray
            ray.shutdown()
    return outcome(grid, steps)


def sweep_shape(run_args: list[str], space: TuneSpace, use_gpu: bool) -> tuple[int, int, Path]:
    """Lint one trial's config per micro-batch (a world of one); returns steps, eval interval, OUT."""
    from bigtrain.config.flags import build_run_parser, run_config_from_args
    for batch in space.micro_batches:
        check_run_args([*run_args, "--set", f"{BATCH_KEY}={batch}"], 1, use_gpu)
    run = run_config_from_args(build_run_parser().parse_args(run_args))
    if run.train.eval_batches <= 0:
        raise ValueError("train.eval_batches is 0: trials need a validation loss; set train.eval_batches=2 or more")
    interval = run.train.eval_interval or run.train.steps
    return run.train.steps, interval, Path(run.train.out_dir)


def outcome(grid: Any, steps: int) -> TuneOutcome:
    """The best trial: lowest last validation loss among those that ran to the end (ASHA lets at
    least one), else among all."""
    rows = []
    for result in grid:
        metrics, config = result.metrics or {}, result.config or {}
        rows.append({LR_KEY: round_lr(config[LR_KEY]), BATCH_KEY: int(config[BATCH_KEY]),
                     "step": int(metrics.get("step", 0)), "val_loss": float(metrics.get("val_loss", math.nan)),
                     "error": str(result.error).strip().splitlines()[0][:200] if result.error else ""})
    done = [r for r in rows if not r["error"] and not math.isnan(r["val_loss"])]
    if not done:
        first = next((r["error"] for r in rows if r["error"]), "no trial reported a validation loss")
        raise RuntimeError(f"every trial failed: {first}")
    finished = [r for r in done if r["step"] >= steps] or done
    best = min(finished, key=lambda r: r["val_loss"])
    settings = {LR_KEY: best[LR_KEY], BATCH_KEY: best[BATCH_KEY]}
    line = " ".join(f"--set {k}={v}" for k, v in settings.items())
    return TuneOutcome(settings, best["val_loss"], best["step"], rows, line, grid)


# --- In each trial (a Ray actor) ---------------------------------------------------------------------

def trial_main(config: dict, job: dict) -> None:
    """One trial: bigtrain's job in this process (a world of one), each evaluation reported to Tune.
    `config` holds the sampled settings, `job` the flags and directories shared by all trials."""
    import ray.tune
    from bigtrain.config.flags import build_run_parser, run_config_from_args
    from bigtrain.train.job import train
    from bigtrain.train.process import JobProcess
    from bigtrain.train.report import add_listener
    if os.path.isdir(job["cwd"]):
        os.chdir(job["cwd"])  # Tune starts trials in their own directory; the flags' paths are the user's
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_run_parser().parse_args(job["run_args"])
    out = Path(job["trials_dir"]) / ray.tune.get_context().get_trial_name()
    args.set = [*args.set, f"{LR_KEY}={round_lr(config[LR_KEY])}", f"{BATCH_KEY}={int(config[BATCH_KEY])}",
                f"train.out_dir={out}"]
    run = run_config_from_args(args)
    last: dict[str, float] = {}

    def report(event: str, step: int, values: dict) -> None:
        if event == "log":
            last["loss"] = float(values["loss"])
        elif event == "eval" and step < run.train.steps:
            ray.tune.report({"step": step, "val_loss": float(values["val_loss"]), **last})

    remove = add_listener(report)
    try:
        with JobProcess.start() as job:
            train(run, job.world, args.deepspeed_config, lifeline=job.lifeline)
        code = job.code
    finally:
        remove()
    if code != 0:
        raise RuntimeError(f"the trial's bigtrain job ended with exit code {code} (its log in {out} says why)")
    # The last evaluation is reported once the job is complete: at max_t ASHA stops the trial at
    # once, which would otherwise cut it off before summary.json and the final checkpoint.
    summary = json.loads((out / "summary.json").read_text())
    step, val_loss = summary["val_losses"][-1]
    ray.tune.report({"step": step, "val_loss": val_loss, "loss": summary["final_loss"]})


# --- CLI ---------------------------------------------------------------------------------------------

def print_outcome(result: TuneOutcome) -> None:
    print(f"{'lr':>10} {'micro_batch':>11} {'step':>5} {'val_loss':>9}  note")
    for row in sorted(result.rows, key=lambda r: (r["val_loss"] if not math.isnan(r["val_loss"]) else math.inf)):
        is_best = (row[LR_KEY], row[BATCH_KEY], row["val_loss"]) == (
            result.best[LR_KEY], result.best[BATCH_KEY], result.best_val_loss)
        note = row["error"] or ("best" if is_best else "")
        print(f"{row[LR_KEY]:>10.3g} {row[BATCH_KEY]:>11d} {row['step']:>5d} {row['val_loss']:>9.4f}  {note}".rstrip())
    print(f"best: val_loss {result.best_val_loss:.4f} at step {result.best_step}")
    print(result.set_line)


def cmd_tune(args: argparse.Namespace) -> int:
    space = TuneSpace.parse(args.lr, args.micro_batch, args.trials, args.seed)
    try:
        result = tune_sweep(args.run_args, space, args.cpus_per_trial, args.gpus_per_trial, args.address,
                            args.storage_path, args.name)
    except RuntimeError as err:
        print(f"bigtrain tune: {err}", file=sys.stderr)
        return 1
    print_outcome(result)
    return 0


def add_tune_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="Ray Tune sweep over lr and micro-batch, ASHA on val loss (needs bigtrain[ray])",
                       description="Everything after the sweep options goes to bigtrain/run.py for every trial "
                                   "(e.g. --model gpt2 --size tiny --steps 100 --set train.eval_interval=10).")
    p.add_argument("--trials", type=int, default=4, help="trials to sample (default 4)")
    p.add_argument("--lr", default="1e-4:3e-3",
                   help="LOW:HIGH sampled log-uniformly, or a list a,b,c (default 1e-4:3e-3)")
    p.add_argument("--micro-batch", default="2,4,8", help="micro-batch sizes to choose from (default 2,4,8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampler (the trials' own seed is train.seed)")
    p.add_argument("--cpus-per-trial", type=int, default=1, help="CPUs per trial (default 1)")
    p.add_argument("--gpus-per-trial", type=float, default=0, help="GPUs per trial (default 0)")
    p.add_argument("--address", default=None, help="Ray cluster address; default: start a local Ray cluster")
    p.add_argument("--storage-path", default=None, help="Tune's storage, shared by every node; default OUT/ray")
    p.add_argument("--name", default=None, help="Tune experiment name (default tune_TIMESTAMP)")
    p.set_defaults(run_args=[], passes_unknown_args=True, func=cmd_tune)
