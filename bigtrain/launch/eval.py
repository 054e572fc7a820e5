"""`bigtrain eval TARGET --tasks A,B [...]`: the verb's launch flags, and the launch of its ranks for --num-gpus N > 1
(the evaluation itself is `bigtrain.eval`).

One rank evaluates in this process; several are started by the DeepSpeed launcher (as `bigtrain train` starts
its ranks, hostfiles included), each running `python -m bigtrain.eval` with the same flags.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

from bigtrain.eval.flags import EPILOG, add_eval_args

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
    from bigtrain.distributed.rendezvous import free_port
    from bigtrain.launch.hosts import ranks_here
    from bigtrain.launch.train import launch_env, launcher_command, rank_0_here
    if rank_0_here(args.hostfile):  # a wrong folder or task name: one line before any rank starts
        from bigtrain.eval.command import check_eval_args
        check_eval_args(args)
    num_ranks = args.num_gpus or ranks_here(args.hostfile)
    port = args.master_port or (None if args.hostfile else free_port())
    cmd = launcher_command(rank_args(args), args.num_gpus, args.hostfile, port, [], args.verbose,
                           module="bigtrain.eval")
    env = launch_env(num_ranks, args.verbose)
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
    from bigtrain.models.hub import is_hub_name
    target = args.target if is_hub_name(args.target) else os.path.abspath(args.target)
    out = [target, "--tasks", args.tasks, "--batch-size", str(args.batch_size)]
    for path in args.include_path:
        out += ["--include-path", os.path.abspath(path)]
    for flag, value in (("--num-fewshot", args.num_fewshot), ("--limit", args.limit), ("--tag", args.tag),
                        ("--tokenizer", args.tokenizer), ("--out", args.out and os.path.abspath(args.out)),
                        ("--revision", args.revision)):
        if value is not None:
            out += [flag, str(value)]
    return out + (["--trust-checkpoint"] if args.trust_checkpoint else []) + (["--zero3"] if args.zero3 else [])
