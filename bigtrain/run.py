"""Entry point for the deepspeed launcher, torchrun, or a plain `python`: args -> run config -> train.

    deepspeed --num_gpus=8 bigtrain/run.py --model gpt2 --size medium \\
        --deepspeed_config ds_configs/zero3_offload.json --data 'corpus/*.txt' --steps 2000 --out runs/m
"""
from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):
    # Run as a script: put the repository root, not bigtrain/, first on the path, so that
    # bigtrain's modules (config, data, ...) never shadow top-level packages of the same name.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    sys.path.insert(0, os.path.dirname(_here))

from bigtrain.cli import FAMILY_HELP, FlagParser  # noqa: E402
from bigtrain.config.run_config import RunConfig  # noqa: E402
from bigtrain.config.load import load_run_config  # noqa: E402
from bigtrain.distributed.op_locks import check_build_locks  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    """Every flag also takes its other spelling (--peak_tflops, --stop_after: FlagParser)."""
    p = FlagParser(description="Train a model with DeepSpeed (see README).",
                   epilog="Every flag may be spelled --snake_case or --kebab-case.")
    p.add_argument("--config", help="run config YAML/JSON")
    p.add_argument("--model", help=f"{FAMILY_HELP} (model.family)")
    p.add_argument("--size", help="named size, e.g. tiny, mini, small, medium (model.size)")
    p.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config",
                   help="a DeepSpeed JSON (e.g. ds_configs/zero3.json); it decides the ZeRO stage, precision, "
                        "offload and batch; linted and fitted to the real world size")
    p.add_argument("--data", help="data source: builtin, synthetic, a file/dir/glob, hf:NAME (data.source)")
    p.add_argument("--steps", type=int, help="optimizer steps (train.steps)")
    p.add_argument("--out", help="output directory (train.out_dir)")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.add_argument("--overwrite", action="store_true",
                   help="start fresh in an --out that holds an earlier run's checkpoints, deleting them (and its "
                        "summary) first; without it such a folder is refused")
    p.add_argument("--trust-checkpoint", "--trust_checkpoint", dest="trust_checkpoint", action="store_true",
                   help="--resume may unpickle any type in the checkpoint's files (runs code from them); only for "
                        "checkpoints you trust. Without it a file needing more than DeepSpeed's types is refused")
    p.add_argument("--seed", type=int, help="seed (train.seed)")
    p.add_argument("--peak-tflops", type=float, help="per-rank peak TFLOP/s for MFU (default: measured)")
    p.add_argument("--stop-after", type=int, help="save and stop after this step (time-boxed jobs, tests)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any run-config field, e.g. --set zero.stage=3 (repeatable)")
    p.add_argument("--verbose", action="store_true",
                   help="also print DeepSpeed's log and torch's warnings here (they are always in OUT/logs/rank*.log)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def run_config_from_args(args: argparse.Namespace) -> RunConfig:
    """Flags are shorthands for --set; --set wins over flags, and both over the config file."""
    shorthands = [("model.family", args.model), ("model.size", args.size), ("data.source", args.data),
                  ("train.steps", args.steps), ("train.out_dir", args.out), ("train.seed", args.seed),
                  ("train.peak_tflops", args.peak_tflops)]
    if args.stop_after is not None and args.stop_after < 1:
        raise ValueError(f"--stop-after {args.stop_after}: must be >= 1 (the step to save and stop after)")
    overrides = [f"{key}={value}" for key, value in shorthands if value is not None]
    return load_run_config(args.config, overrides + list(args.set))


def config_sources(args: argparse.Namespace) -> dict[str, str]:
    """The run-config fields given by --config or by --set/flags: an explicit --set wins over a
    DeepSpeed JSON, the JSON over --config (bigtrain.ds.resolve)."""
    from bigtrain.config.load import field_sources
    flags = {"model.family": args.model, "model.size": args.size, "data.source": args.data,
             "train.steps": args.steps, "train.out_dir": args.out, "train.seed": args.seed,
             "train.peak_tflops": args.peak_tflops}
    return field_sources(args.config, [f"{k}=" for k, v in flags.items() if v is not None] + list(args.set))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from bigtrain.metrics.logs import quiet_hf_progress_bars, route_library_logs
    route_library_logs(verbose=args.verbose, console=sys.stderr)  # before anything imports DeepSpeed
    if not args.verbose:
        quiet_hf_progress_bars()
    try:
        run = run_config_from_args(args)
        # before the process group: DeepSpeed builds its CPU all-reduce op there, and a killed build's lock
        # would hang it (and the engine's FusedAdam / CPU Adam build later) without a word
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


def exit_now(code: int) -> None:
    """End the process once the job is over (summary, checkpoint and monitors written, process
    group destroyed) without the interpreter's teardown: there, a DeepSpeed/gloo thread that is
    still joinable sometimes aborts the process ("terminate called without an active exception"),
    and a finished job would then report exit status 250 to the launcher."""
    import logging
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
