"""Entry point for the deepspeed launcher, torchrun, or a plain `python`: args -> run config -> train.

    deepspeed --num_gpus=8 bigtrain/run.py --model gpt2 --size medium \\
        --deepspeed_config ds_configs/zero3_offload.json --data 'corpus/*.txt' --steps 2000 --out runs/m
"""
from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    # Run as a script: put the repository root, not bigtrain/, first on the path, so that
    # bigtrain's modules (config, data, ...) never shadow top-level packages of the same name.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    sys.path.insert(0, os.path.dirname(_here))

from bigtrain.config.flags import build_run_parser, config_sources, run_config_from_args  # noqa: E402
from bigtrain.distributed.op_builds import use_environment_ops_dir  # noqa: E402
from bigtrain.distributed.op_locks import check_build_locks  # noqa: E402
from bigtrain.train.precheck import check_run, checked_by_launcher  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    from bigtrain.train.collector import paused_for_start
    with paused_for_start():  # until the first step (train.collector.settle)
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    args = build_run_parser().parse_args(argv)
    from bigtrain.metrics.logs import quiet_hf_progress_bars, route_library_logs
    route_library_logs(verbose=args.verbose, console=sys.stderr)  # before anything imports DeepSpeed
    if not args.verbose:
        quiet_hf_progress_bars()
    try:
        run = run_config_from_args(args)
        if not checked_by_launcher():  # started by a launcher directly: the mistakes that need no process group
            check_run(run, resume=args.resume, overwrite=args.overwrite,
                      world_size=int(os.environ.get("WORLD_SIZE", "1")), ds_config=args.deepspeed_config,
                      sources=config_sources(args))
        # before the process group: DeepSpeed builds its CPU all-reduce op there, and a killed build's lock
        # would hang it (and the engine's FusedAdam / CPU Adam build later) without a word
        use_environment_ops_dir()  # the ops of this environment, which its locks guard
        lock_warnings = check_build_locks()
    except ValueError as err:
        if os.environ.get("RANK", "0") == "0":  # every rank finds it; one says it
            print(f"bigtrain: {err}", file=sys.stderr)
        return 2
    if os.environ.get("LOCAL_RANK", "0") == "0":
        for line in lock_warnings:
            print(f"bigtrain: warning: {line}", file=sys.stderr)
    from bigtrain.train.job import train
    from bigtrain.train.process import JobProcess
    with JobProcess.start() as job:  # the process group, the console, and the exit code of a stop
        train(run, job.world, args.deepspeed_config, args.resume, args.stop_after, sources=config_sources(args),
              trust_checkpoint=args.trust_checkpoint, overwrite=args.overwrite, lifeline=job.lifeline)
    return job.code


if __name__ == "__main__":
    from bigtrain.distributed.world import exit_now
    exit_now(main())
