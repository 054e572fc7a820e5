"""The command line's grammar, shared by every verb: flags in both spellings, `--config` + `--set section.field=...`,
and the run's flags (`bigtrain/run.py`, `bigtrain train`), each a shorthand for one `--set`.

Nothing here imports torch or DeepSpeed: `bigtrain --help` builds every verb's parser from it at once.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from bigtrain.config.load import field_sources, load_run_config
from bigtrain.config.run_config import RunConfig

# The --model help of every verb that takes one (bigtrain.run, estimate, preflight).
FAMILY_HELP = (
    "model family: gpt2, llama, hf (a local Hugging Face directory, model.pretrained), vlm (a vision-language model's "
    "directory, its processor beside it), encoder, resnet")

# The run's shorthand flags: argparse dest -> the run-config field it sets (`--steps 10` = `--set train.steps=10`).
RUN_FLAGS = {"model": "model.family", "size": "model.size", "data": "data.source", "steps": "train.steps",
             "out": "train.out_dir", "seed": "train.seed", "peak_tflops": "train.peak_tflops"}


class FlagParser(argparse.ArgumentParser):
    """An ArgumentParser that takes every long flag as `--snake_case` or `--kebab-case`.

    DeepSpeed's launcher and scripts spell flags `--num_gpus`, POSIX tools `--num-gpus`; users
    type both. A flag this parser does not know under the spelling given is looked up under the
    other spelling before argparse sees it. Subparsers made with `add_subparsers().add_parser`
    are of this class too, so every verb gets it without registering both names.
    """

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(self.known_spellings(args), namespace)

    def known_spellings(self, args: list[str]) -> list[str]:
        """`args` with each long flag in the spelling this parser registered (up to a bare `--`)."""
        out = []
        for i, arg in enumerate(args):
            if arg == "--":
                return out + args[i:]
            out.append(self._spelling(arg))
        return out

    def _spelling(self, arg: str) -> str:
        if not arg.startswith("--") or len(arg) < 3:
            return arg
        name, eq, value = arg.partition("=")
        if name in self._option_string_actions:
            return arg
        for other in ("--" + name[2:].replace("_", "-"), "--" + name[2:].replace("-", "_")):
            if other in self._option_string_actions:
                return other + eq + value
        return arg


def add_run_config_args(parser: argparse.ArgumentParser, config_help: str = "run config YAML/JSON") -> None:
    """`--config FILE` and the repeatable `--set section.field=VALUE`, as every verb takes them."""
    parser.add_argument("--config", help=config_help)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override any run-config field, e.g. --set zero.stage=3 or "
                             "--set model.overrides.n_layer=24 (repeatable)")


def build_run_parser() -> FlagParser:
    """The flags of `bigtrain/run.py` (and of what `bigtrain train` passes on to it)."""
    p = FlagParser(description="Train a model with DeepSpeed (see README).",
                   epilog="Every flag may be spelled --snake_case or --kebab-case.")
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
    add_run_config_args(p)
    p.add_argument("--verbose", action="store_true",
                   help="also print DeepSpeed's log and torch's warnings here (they are always in OUT/logs/rank*.log)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def shorthand_sets(args: argparse.Namespace) -> list[str]:
    """The `--set` each run flag given stands for (`--steps 10` -> "train.steps=10"), in RUN_FLAGS order."""
    return [f"{key}={getattr(args, dest)}" for dest, key in RUN_FLAGS.items()
            if getattr(args, dest, None) is not None]


def run_config_from_args(args: argparse.Namespace) -> RunConfig:
    """Flags are shorthands for --set; --set wins over flags, and both over the config file."""
    if getattr(args, "stop_after", None) is not None and args.stop_after < 1:
        raise ValueError(f"--stop-after {args.stop_after}: must be >= 1 (the step to save and stop after)")
    return load_run_config(args.config, shorthand_sets(args) + list(args.set))


def config_sources(args: argparse.Namespace) -> dict[str, str]:
    """The run-config fields given by --config or by --set/flags: an explicit --set wins over a
    DeepSpeed JSON, the JSON over --config (bigtrain.ds.resolve)."""
    return field_sources(args.config, shorthand_sets(args) + list(args.set))
