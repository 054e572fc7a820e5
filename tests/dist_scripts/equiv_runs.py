"""Run by tests/dist/test_equivalence.py, test_reshape_resume.py, test_export.py and test_compile_training.py
on its ranks (tests/launch.py: launch_jobs): several runner jobs (`bigtrain.train.job.train`, what `bigtrain/run.py` calls) one after
another in one launch, because on a 2-core CPU the launcher's start-up, imports and process
group set-up cost ~20 s while a tiny model's 10 steps take ~1 s.

Usage: equiv_runs.py ROOT PLAN.json
PLAN.json is a list of jobs, each {"name": str, "args": [run.py arguments]} plus optionally
- "copy_from": NAME  copy ROOT/NAME first (rank 0), to resume from that job's checkpoints;
- "expect_error": true  the job must fail with a ValueError (a user's mistake); its message
  goes to ROOT/NAME/error.txt;
- "call": "MODULE.FUNCTION"  instead of a run, FUNCTION(ROOT/NAME, world) of tests/dist_scripts/MODULE.py on every
  rank: a check on an engine of its own that would otherwise need a launch of its own (its state goes with the job);
- "plot": true  draw the run's loss.png (matplotlib: ~1 s of a 2-core CPU per job, so only for a test that reads
  the plot; tests/unit/test_cli.py and test_eval_runs.py do).
Each job trains with `--out ROOT/NAME` and writes summary.json there; this script adds
ROOT/NAME/probe_rank{R}.json: the optimizer classes DeepSpeed built and how many blocks ran
through DeepSpeed's activation checkpointing, and a line with each job's wall time.

Order matters: DeepSpeed keeps process-wide state, so a pipeline job goes last (its grid stays
in `deepspeed.utils.groups`), and transformers' ZeRO-3 switch is cleared after each job (a
live ZeRO-3 model leaves it on). After each job what is still alive (the modules imported, DeepSpeed's registries)
is frozen out of the garbage collector's view: a full collection walks every live object, half a million here by
the second job, ~1 s per collection per rank that the next job would pay again for nothing.
"""
from __future__ import annotations

import gc

gc.disable()  # through the imports and the first job's start, as bigtrain/run.py does (bigtrain.train.collector)
import importlib
import json
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import deepspeed
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(Path(__file__).resolve().parent))  # the modules a "call" job names

from bigtrain.distributed.world import World, barrier, init_distributed, shutdown  # noqa: E402
from bigtrain.train import job as job_module  # noqa: E402
from bigtrain.train.job import train  # noqa: E402
from bigtrain.train.process import setup_logging  # noqa: E402
from bigtrain.config.flags import build_run_parser, run_config_from_args  # noqa: E402


@contextmanager
def loss_plot(drawn: bool) -> Iterator[None]:
    """The job's loss.png as the runner draws it, or (the default here) not drawn."""
    original = job_module.write_loss_plot
    if not drawn:
        job_module.write_loss_plot = lambda summary, path: None
    try:
        yield
    finally:
        job_module.write_loss_plot = original


@contextmanager
def probe(report: dict) -> Iterator[None]:
    """Record the optimizer DeepSpeed built and count activation-checkpointed block calls."""
    initialize = deepspeed.initialize
    names = ("checkpoint", "non_reentrant_checkpoint")
    checkpoint_fns = {name: getattr(deepspeed.checkpointing, name) for name in names}
    report["checkpoint_calls"] = 0

    def counting(fn):
        def call(*args: Any, **kwargs: Any) -> Any:
            report["checkpoint_calls"] += 1
            return fn(*args, **kwargs)
        return call

    def recording_initialize(*args: Any, **kwargs: Any) -> Any:
        result = initialize(*args, **kwargs)
        optimizer = result[1]
        report["optimizer"] = type(optimizer).__name__
        report["base_optimizer"] = type(getattr(optimizer, "optimizer", optimizer)).__name__
        return result

    deepspeed.initialize = recording_initialize
    for name, fn in checkpoint_fns.items():
        setattr(deepspeed.checkpointing, name, counting(fn))
    try:
        yield
    finally:
        deepspeed.initialize = initialize
        for name, fn in checkpoint_fns.items():
            setattr(deepspeed.checkpointing, name, fn)


def run_one(root: Path, job: dict, world: World) -> None:
    started = time.perf_counter()
    out = root / job["name"]
    if job.get("call"):
        module, function = job["call"].rsplit(".", 1)
        getattr(importlib.import_module(module), function)(out, world)
        finish(job, world, started)
        return
    if job.get("copy_from") and world.is_main:
        shutil.copytree(root / job["copy_from"], out)
        (out / "summary.json").unlink(missing_ok=True)  # the resumed job writes its own
    barrier()
    args = build_run_parser().parse_args(["--out", str(out), *job["args"]])
    report: dict = {}
    try:
        with probe(report), loss_plot(job.get("plot", False)):
            train(run_config_from_args(args), world, args.deepspeed_config, args.resume, args.stop_after)
    except ValueError as err:
        if not job.get("expect_error"):
            raise
        out.mkdir(parents=True, exist_ok=True)
        if world.is_main:
            (out / "error.txt").write_text(str(err))
    else:
        assert not job.get("expect_error"), f"job {job['name']} was expected to fail with a ValueError"
        assert job.get("plot") or not (out / "loss.png").exists(), \
            "loss.png drawn although not asked: the runner no longer draws it through train.job.write_loss_plot"
    (out / f"probe_rank{world.rank}.json").write_text(json.dumps(report))
    finish(job, world, started)


def finish(job: dict, world: World, started: float) -> None:
    unset_hf_deepspeed_config()
    gc.collect()
    gc.freeze()  # the survivors are the process's for good: later collections skip them
    gc.enable()  # a plan whose first jobs are calls, not runs, has not had its collector resumed by a run's start
    barrier()
    if world.is_main:  # what each job costs, in the launch's log (tests/launch.py returns it)
        print(f"equiv_runs: job {job['name']} took {time.perf_counter() - started:.1f} s", flush=True)


def main() -> None:
    root, plan = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    world = init_distributed()
    setup_logging(world)
    for job in json.loads(Path(plan).read_text()):
        run_one(Path(root), job, world)
    shutdown()


if __name__ == "__main__":
    main()
