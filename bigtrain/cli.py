"""`bigtrain <verb>`: configs | lint | train | estimate | export | bench | preflight | prepare.

Each verb lives in its own module; this file only wires argparse to them. A user's mistake
ends with one line on stderr and exit code 2, never a stack trace.
"""
from __future__ import annotations

import argparse
import json
import sys

from bigtrain.ds.lint import LintError


def cmd_configs(args: argparse.Namespace) -> int:
    from bigtrain.ds.files import stale_files, write_files
    if args.check:
        stale = stale_files(args.out, args.world_size)
        if stale:
            print(f"stale in {args.out}: {', '.join(stale)}; run `bigtrain configs --out {args.out}`", file=sys.stderr)
            return 1
        print(f"{args.out} is up to date")
        return 0
    for path in write_files(args.out, args.world_size):
        print(f"wrote {path}")
    return 0


def cmd_lint(args: argparse.Namespace) -> int:
    from bigtrain.config.load import load_run_config
    from bigtrain.ds.resolve import resolve_ds_file
    run = load_run_config(args.config, args.set)
    resolved = resolve_ds_file(args.file, run, args.world_size, args.pipeline_stages)
    for note in resolved.notes:
        print(f"note: {note}", file=sys.stderr)
    print(json.dumps(resolved.ds_config, indent=2))
    return 0


def add_run_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="run config YAML/JSON (see bigtrain/config.py)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a run-config field, e.g. --set zero.stage=3 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bigtrain", description="Train large models with DeepSpeed.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("configs", help="write the DeepSpeed configs in ds_configs/ from the presets")
    p.add_argument("--out", default="ds_configs", help="output directory (default ds_configs)")
    p.add_argument("--world-size", type=int, default=8, help="reference world size the files are written for")
    p.add_argument("--check", action="store_true", help="only check that the files are up to date")
    p.set_defaults(func=cmd_configs)

    p = sub.add_parser("lint", help="check and resolve a DeepSpeed JSON (HF-style \"auto\" values too)")
    p.add_argument("file", help="DeepSpeed config JSON")
    p.add_argument("--world-size", type=int, default=None, help="ranks it will run on (checks the batch triple)")
    p.add_argument("--pipeline-stages", type=int, default=None, help="pipeline stages it will run with")
    add_run_config_args(p)
    p.set_defaults(func=cmd_lint)

    from bigtrain.bench.cli import add_bench_parser
    from bigtrain.data.prepare.cli import add_prepare_parser
    from bigtrain.estimate.cli import add_estimate_parser
    from bigtrain.export import add_export_parser
    from bigtrain.models.cli import add_models_parser
    from bigtrain.launch.preflight import add_preflight_parser
    from bigtrain.launch.train import add_train_parser
    for register in (add_train_parser, add_estimate_parser, add_export_parser, add_models_parser,
                     add_preflight_parser, add_bench_parser, add_prepare_parser):
        register(sub)
    return parser


def deepspeed_logs_to_stderr() -> None:
    """DeepSpeed's logger writes to the stdout it saw at import; the CLI's stdout is for results."""
    import contextlib
    with contextlib.redirect_stdout(sys.stderr):
        import deepspeed  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    deepspeed_logs_to_stderr()
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "passes_unknown_args", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if unknown:
        args.run_args = [*args.run_args, *unknown]
    try:
        return int(args.func(args) or 0)
    except LintError as err:
        for problem in err.problems:
            print(f"bigtrain {args.command}: {problem}", file=sys.stderr)
        return 2
    except ValueError as err:
        print(f"bigtrain {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
