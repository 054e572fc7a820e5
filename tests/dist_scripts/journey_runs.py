"""Run by tests/dist/test_journey.py through torchrun: several user jobs one after another in one launch (a
launch's start-up costs ~20 s on a 2-core CPU, a tiny job a few seconds), each exactly as `bigtrain/run.py` runs
it -- its flags parsed by run.py's parser, the fields the user gave passed on for the precedence against the
DeepSpeed JSON, the end-of-run sample included -- but for its loss.png, which no check here reads (matplotlib: ~1 s
of a 2-core CPU per job; the journey's own run.py launch draws it). DeepSpeed's launcher is the journey's other launch.

Usage: journey_runs.py ROOT PLAN.json
PLAN.json is a list of jobs, each {"name": str, "args": [run.py arguments]}, optionally with
"copy_from": NAME (rank 0 copies ROOT/NAME first, to resume from its checkpoints). Each job
trains with `--out ROOT/NAME`; rank 0 prints `=== job NAME ===` before it and
`=== job NAME exit 0 (S s) ===` after it (1 and the error on a failure; the next job still runs), so the
test can cut the log into jobs. A pipeline job must come last (DeepSpeed keeps its grid). After each job what is
still alive is frozen out of the garbage collector's view (as in equiv_runs.py: a full collection otherwise walks
every module and registry again after each job, ~1 s per rank by the second job).
"""
from __future__ import annotations

import gc
import json
import shutil
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from transformers.integrations.deepspeed import unset_hf_deepspeed_config  # noqa: E402

from bigtrain.distributed.world import World, barrier, init_distributed, shutdown  # noqa: E402
from bigtrain.config.flags import build_run_parser, config_sources, run_config_from_args  # noqa: E402
from bigtrain.train import job as job_module  # noqa: E402
from bigtrain.train.job import train  # noqa: E402
from bigtrain.train.process import setup_logging  # noqa: E402


def run_one(root: Path, job: dict, world: World) -> None:
    out = root / job["name"]
    if job.get("copy_from") and world.is_main:
        shutil.copytree(root / job["copy_from"], out)
        (out / "summary.json").unlink(missing_ok=True)
    barrier()
    if world.is_main:
        print(f"=== job {job['name']} ===", flush=True)
    args = build_run_parser().parse_args(["--out", str(out), *job["args"]])
    code, start = 0, time.monotonic()
    try:
        train(run_config_from_args(args), world, args.deepspeed_config, args.resume, args.stop_after,
              sources=config_sources(args))
    except Exception:  # noqa: BLE001 -- reported per job; the test names the job that failed
        code = 1
        traceback.print_exc(file=sys.stdout)  # inside this job's part of the log
    if world.is_main:
        print(f"=== job {job['name']} exit {code} ({time.monotonic() - start:.1f} s) ===", flush=True)
    unset_hf_deepspeed_config()  # a ZeRO-3 job leaves transformers' switch on
    gc.collect()
    gc.freeze()  # the survivors are the process's for good: later collections skip them
    barrier()


def main() -> None:
    root, plan = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    world = init_distributed()
    setup_logging(world)
    job_module.write_loss_plot = lambda summary, path: None  # no check reads it (the docstring)
    for job in json.loads(Path(plan).read_text()):
        run_one(Path(root), job, world)
    shutdown()


if __name__ == "__main__":
    main()
