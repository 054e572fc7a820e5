"""`bigtrain eval TARGET --tasks A,B [...]`: the verb's flags, and the launch of its ranks for --num-gpus N > 1.

One rank evaluates in this process; several are started by the DeepSpeed launcher (as `bigtrain train` starts
its ranks, hostfiles included), each running `python -m bigtrain.eval` with the same flags.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

EPILOG = """TARGET is a run folder (its newest complete checkpoint, or --tag, consolidated in memory; a LoRA run
with its adapters merged) or a Hugging Face model directory (a `bigtrain export`, any local causal LM, a peft
adapter directory). Tasks are lm-eval's (their data from the Hugging Face cache or hub) or your own: a folder of
task YAML files given with --include-path (dataset_path: json, data_files: your files; docs/evaluation.md).
With --num-gpus N the forward passes are split over N ranks, which give exactly the numbers one rank gives."""


def add_eval_args(p: argparse.ArgumentParser) -> None:
    """The flags every rank reads (the verb's own launch flags are added by `add_eval_parser`)."""
    p.add_argument("target", help="run folder (--out of a run, its checkpoints/ or a step_NNNNNN dir) or model dir")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task, group or tag names")
    p.add_argument("--include-path", action="append", default=[],
                   metavar="DIR", help="a folder of your own lm-eval task YAML files (repeatable)")
    p.add_argument("--num-fewshot", type=int, default=None,
                   help="few-shot examples per prompt (default: each task's own)")
    p.add_argument("--limit", type=_limit, default=None,
                   help="at most N documents per task (or a fraction < 1 of them): for quick checks, not for scores")
    p.add_argument("--batch-size", type=int, default=8,
                   help="requests per forward pass on each rank (default 8)")
    p.add_argument("--out", default=None,
                   help="results JSON to write (default: RUN/eval/<tag>.json for a run folder, "
                        "DIR/eval_results.json for a model directory)")
    p.add_argument("--tag", default=None, help="run folder: the checkpoint to evaluate, e.g. step_000120 or 120 "
                                               "(default: the newest complete one)")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir or name (default: the run's, or the directory's)")
    p.add_argument("--zero3", action="store_true",
                   help="a model too large for one device: hold it as ZeRO-3 partitions over the ranks (1/N of each "
                        "weight per device; rank 0 consolidates it in host memory); every rank then runs every "
                        "forward pass. Needs --num-gpus N > 1 or --hostfile")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="unpickle any type in the checkpoint's files (only for checkpoints you trust)")


def add_eval_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `bigtrain eval`."""
    p = sub.add_parser("eval", help="score a run or a model directory on lm-evaluation-harness tasks",
                       description=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_eval_args(p)
    p.add_argument("--num-gpus", type=int, default=None,
                   help="ranks on this machine (default 1: this process; with --hostfile, ranks per node)")
    p.add_argument("--hostfile", default=None, help="multi-node hostfile (see hostfile.example)")
    p.add_argument("--master-port", type=int, default=None, help="rendezvous port for several ranks")
    p.add_argument("--verbose", action="store_true", help="also print the launcher's and DeepSpeed's own lines")
    p.set_defaults(func=cmd_eval)
    return p


def build_rank_parser() -> argparse.ArgumentParser:
    from bigtrain.cli import FlagParser
    p = FlagParser(prog="python -m bigtrain.eval", description=EPILOG,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    add_eval_args(p)
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # the DeepSpeed launcher's
    p.add_argument("--verbose", action="store_true", help="DeepSpeed's and torch's own lines too")
    return p


def cmd_eval(args: argparse.Namespace) -> int:
    if args.num_gpus is not None and args.num_gpus < 1:
        raise ValueError(f"--num-gpus {args.num_gpus}: must be >= 1")
    if not args.hostfile and (args.num_gpus or 1) == 1:
        if args.zero3:
            raise ValueError("--zero3 partitions the model over several ranks: give --num-gpus N (N > 1) or "
                             "--hostfile, or drop --zero3 to hold the whole model in this process")
        from bigtrain.distributed.world import World
        from bigtrain.eval.command import run_eval
        from bigtrain.metrics.logs import quiet_hf_progress_bars
        quiet_hf_progress_bars()
        return run_eval(args, World(0, 0, 1))
    from bigtrain.eval.harness import require_lm_eval
    require_lm_eval()  # one line here rather than one per rank
    from bigtrain.launch.console import copy_filtered
    from bigtrain.launch.train import free_port, launcher_command, ranks_here, thread_env
    num_ranks = args.num_gpus or ranks_here(args.hostfile)
    port = args.master_port or (None if args.hostfile else free_port())
    cmd = launcher_command(rank_args(args), args.num_gpus, args.hostfile, port, [], args.verbose,
                           module="bigtrain.eval")
    env = thread_env(num_ranks)
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    piped = None if args.verbose else subprocess.PIPE
    child = subprocess.Popen(cmd, env=env, stdout=piped, stderr=piped)
    consoles = [] if args.verbose else [copy_filtered(child.stdout, sys.stdout),
                                        copy_filtered(child.stderr, sys.stderr)]
    code = child.wait()
    for console in consoles:
        console.join(timeout=10)
    return code


def rank_args(args: argparse.Namespace) -> list[str]:
    """The flags each launched rank gets: everything but the launch flags, paths made absolute (a rank on another
    node starts in its home directory)."""
    out = [os.path.abspath(args.target), "--tasks", args.tasks, "--batch-size", str(args.batch_size)]
    for path in args.include_path:
        out += ["--include-path", os.path.abspath(path)]
    for flag, value in (("--num-fewshot", args.num_fewshot), ("--limit", args.limit), ("--tag", args.tag),
                        ("--tokenizer", args.tokenizer), ("--out", args.out and os.path.abspath(args.out))):
        if value is not None:
            out += [flag, str(value)]
    return out + (["--trust-checkpoint"] if args.trust_checkpoint else []) + (["--zero3"] if args.zero3 else [])


def _limit(text: str) -> float | int:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text}: give a number of documents (> 0) or a fraction in (0, 1)")
    return int(value) if value >= 1 and value == int(value) else value
