"""`bigtrain <verb>`: configs | lint | train | estimate | export | models | preflight | bench | plot ...

Each verb lives in its own module and registers its subparser (VERBS, one line each); this file
only wires argparse to them. Building the parser imports no torch or DeepSpeed, so `bigtrain
--help` and every verb's `--help` start at once: a verb imports what it needs when it runs
(tests/unit/test_cli.py holds every verb module to that). Every flag takes both spellings,
`--num_gpus` and `--num-gpus`. A user's mistake ends with one line on stderr and exit code 2,
never a stack trace.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys

from bigtrain.config.flags import FAMILY_HELP, FlagParser, add_run_config_args

# One line per verb: "module:function" that adds its subparser (imported when the parser is built,
# so the module must not import torch/DeepSpeed at its top; tests/unit/test_cli.py checks).
VERBS = [
    "bigtrain.launch.train:add_train_parser",
    "bigtrain.estimate.arguments:add_estimate_parser",
    "bigtrain.export.cli:add_export_parser",
    "bigtrain.launch.eval:add_eval_parser",
    "bigtrain.launch.generate:add_generate_parser",
    "bigtrain.models.cli:add_models_parser",
    "bigtrain.launch.preflight:add_preflight_parser",
    "bigtrain.launch.ray_train:add_ray_train_parser",
    "bigtrain.launch.tune:add_tune_parser",
    "bigtrain.bench.cli:add_bench_parser",
    "bigtrain.metrics.plot:add_plot_parser",
    "bigtrain.data.prepare.cli:add_prepare_parser",
    "bigtrain.recipes.cli:add_recipes_parser",
]


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
    from bigtrain.config.load import field_sources, load_run_config
    from bigtrain.ds.lint import DeviceCaps
    from bigtrain.ds.resolve import resolve_ds_file
    overrides = ([f"model.family={args.model}"] if args.model else []) + args.set
    run = load_run_config(args.config, overrides)
    device = DeviceCaps.for_device(args.device)
    world = args.world_size
    if world is None:  # what `bigtrain train` starts here
        from bigtrain.launch.hosts import default_num_ranks
        world = default_num_ranks()
        print(f"note: no --world-size: checking for {world} rank(s), what `bigtrain train` starts on this machine",
              file=sys.stderr)
    sources = field_sources(args.config, overrides)
    resolved = resolve_ds_file(args.file, run, world, args.pipeline_stages, device=device, fit_world=True,
                               sources=sources)  # the runner's precedence
    from bigtrain.ds.groups import group_problem
    if line := group_problem(run, args.file, world, sources, ds_config=resolved.ds_config, device=device):
        raise ValueError(line)  # whole groups of online RL's completions on every rank, as the runner checks
    from bigtrain.parallel.split_rules import check_split_layout
    from bigtrain.config.topology import Topology
    named = "model.family" in field_sources(args.config, overrides)  # else the default family is nobody's choice
    split_note = check_split_layout(resolved.run, Topology.of(resolved.ds_config, world), family_given=named)
    # the lint's warnings, the precedence lines, filled sections, batch fitting
    for note in resolved.notes + ([split_note] if split_note else []):
        print(note if note.startswith("warning: ") else f"note: {note}", file=sys.stderr)
    print(json.dumps(resolved.ds_config, indent=2))
    return 0


def version_line() -> str:
    """bigtrain's version and the versions it runs with, read from the installed metadata (no imports)."""
    from importlib.metadata import PackageNotFoundError, version

    from bigtrain import __version__
    found = []
    for dist in ("deepspeed", "torch", "transformers"):
        try:
            found.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            found.append(f"{dist} not installed")
    return f"bigtrain {__version__} ({', '.join(found)}, python {sys.version.split()[0]})"


class _Version(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        print(version_line())
        parser.exit()


def build_parser() -> FlagParser:
    parser = FlagParser(prog="bigtrain", description="Train large models with DeepSpeed.",
                        epilog="Every flag may be spelled --snake_case or --kebab-case. "
                               "`bigtrain VERB --help` for a verb's flags.")
    parser.add_argument("--version", action=_Version, help="print the versions of bigtrain, DeepSpeed, torch and "
                                                            "transformers, and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="VERB")

    p = sub.add_parser("configs", help="write the DeepSpeed configs in ds_configs/ from the presets")
    p.add_argument("--out", default="ds_configs", help="output directory (default ds_configs)")
    p.add_argument("--world-size", type=int, default=8, help="reference world size the files are written for")
    p.add_argument("--check", action="store_true", help="only check that the files are up to date")
    p.set_defaults(func=cmd_configs)

    p = sub.add_parser("lint", help="check and resolve a DeepSpeed JSON (HF-style \"auto\" values too)")
    p.add_argument("file", help="DeepSpeed config JSON")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks it will run on (default: this machine's device count); a batch triple written for "
                        "another size is refitted as the runner does")
    p.add_argument("--pipeline-stages", type=int, default=None, help="pipeline stages it will run with")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="device the checks assume (fp16, Lamb's GPU kernel, NVMe offload): auto = this machine; "
                        "cuda checks a GPU config on a login node")
    p.add_argument("--model", default=None, help=FAMILY_HELP + "; judges the split against it (default: none, "
                                                                "the JSON judged as DeepSpeed judges it)")
    add_run_config_args(p, "run config YAML/JSON (see bigtrain/config/run_config.py)")
    p.set_defaults(func=cmd_lint)

    for entry in VERBS:
        module, _, function = entry.partition(":")
        getattr(importlib.import_module(module), function)(sub)
    return parser


def misspelt_flag_line(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """One line for a long flag the verb does not take (`export --output`, `generate --promt`), naming the nearest
    one it does; None for verbs that pass what they do not know on (`train` to its ranks: it says so itself)."""
    import difflib
    verb, path = parser, []
    while len(path) < len(argv):  # down the verbs and their own (`recipes cp`)
        choices = next((a.choices for a in verb._actions if isinstance(a, argparse._SubParsersAction)), {})
        if argv[len(path)] not in choices:
            break
        verb = choices[argv[len(path)]]
        path.append(argv[len(path)])
    if not path or verb.get_default("passes_unknown_args"):
        return None
    spelled = {s.replace("_", "-") for a in verb._actions for s in a.option_strings if s.startswith("--")}
    for arg in argv[len(path):]:
        if arg == "--":
            break
        name = arg.split("=", 1)[0].replace("_", "-")
        if not name.startswith("--") or name in spelled or any(k.startswith(name) for k in spelled):
            continue  # a value, a flag of the verb, or a prefix argparse takes for one
        near = difflib.get_close_matches(name, sorted(spelled), n=1, cutoff=0.6)
        hint = f"did you mean {near[0]}?" if near else f"`bigtrain {' '.join(path)} --help` lists them"
        return f"bigtrain {' '.join(path)}: unknown argument {arg.split('=', 1)[0]!r}; {hint}"
    return None


def main(argv: list[str] | None = None) -> int:
    from bigtrain.metrics.logs import route_library_logs
    # DeepSpeed prints to stdout, which is the verbs' results (lint's JSON): its lines are held
    # back, errors go to stderr. `bigtrain train` ranks keep theirs in the run's log files.
    route_library_logs(console=sys.stderr)
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if line := misspelt_flag_line(parser, argv):  # before argparse: its "required: --out" would hide the typo
        print(line, file=sys.stderr)
        return 2
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "passes_unknown_args", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if unknown:
        args.run_args = [*args.run_args, *unknown]
    from bigtrain.ds.lint import LintError
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
