"""`bigtrain generate TARGET --prompt ...` and `bigtrain chat TARGET`: the verbs' launch flags, and the launch of
their ranks for --zero3 (the generation itself is `bigtrain.generate`).

One process talks to the model here; with --zero3 --num-gpus N the DeepSpeed launcher starts N ranks running
`python -m bigtrain.generate` (as `bigtrain eval` starts its ranks), which share this terminal: rank 0 reads it and
prints, their output passes through unfiltered so that an answer streams as it is generated.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

from bigtrain.generate.flags import TARGET_HELP, add_generate_args, add_target_args


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    """Register `bigtrain generate` and `bigtrain chat`."""
    p = sub.add_parser("generate", help="generate from a run, an export, an adapter or a Hub model",
                       description=TARGET_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_generate_args(p)
    _launch_args(p)
    p.set_defaults(func=cmd_generate, mode="generate")
    p = sub.add_parser("chat", help="talk to a run, an export, an adapter or a Hub model in the terminal",
                       description=TARGET_HELP + " In the chat: /reset, /system TEXT, /exit or Ctrl-D.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(p)
    _launch_args(p)
    p.set_defaults(func=cmd_generate, mode="chat", prompt=[], prompts_file=None, out=None)


def _launch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-gpus", type=int, default=None, help="with --zero3: ranks on this machine")
    p.add_argument("--hostfile", default=None, help="with --zero3: multi-node hostfile (see hostfile.example)")
    p.add_argument("--master-port", type=int, default=None, help="rendezvous port for several ranks")
    p.add_argument("--verbose", action="store_true", help="also print the launcher's and DeepSpeed's own lines")


def cmd_generate(args: argparse.Namespace) -> int:
    from bigtrain.eval.target import target_kind
    from bigtrain.generate.sampling import sampling_from_args
    sampling_from_args(args)  # a bad value: one line before anything loads
    target_kind(args.target, args.tag, args.revision)
    if args.num_gpus is not None and args.num_gpus < 1:
        raise ValueError(f"--num-gpus {args.num_gpus}: must be >= 1")
    several = bool(args.hostfile) or (args.num_gpus or 1) > 1
    if several and not args.zero3:
        raise ValueError(f"bigtrain {args.mode} runs in one process; several ranks hold one model too large for one "
                         "device as ZeRO-3 partitions: add --zero3, or drop --num-gpus / --hostfile")
    if not several:
        if args.zero3:
            raise ValueError("--zero3 partitions the model over several ranks: give --num-gpus N (N > 1) or "
                             "--hostfile, or drop --zero3 to hold the whole model in this process")
        from bigtrain.distributed.world import World
        from bigtrain.generate.command import run_chat, run_generate
        from bigtrain.metrics.logs import quiet_hf_progress_bars
        quiet_hf_progress_bars()
        return (run_chat if args.mode == "chat" else run_generate)(args, World(0, 0, 1))
    return launch_ranks(args)


def launch_ranks(args: argparse.Namespace) -> int:
    from bigtrain.distributed.rendezvous import free_port
    from bigtrain.launch.hosts import ranks_here
    from bigtrain.launch.train import launch_env, launcher_command
    num_ranks = args.num_gpus or ranks_here(args.hostfile)
    port = args.master_port or (None if args.hostfile else free_port())
    cmd = launcher_command(rank_args(args), args.num_gpus, args.hostfile, port, [], args.verbose,
                           module="bigtrain.generate")
    env = launch_env(num_ranks, args.verbose)  # the ranks' stdout is the answers: no detection line from each
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.call(cmd, env=env)  # the terminal is the ranks' own: rank 0 reads it, streams to it


def rank_args(args: argparse.Namespace) -> list[str]:
    """The flags each launched rank gets: everything but the launch flags, paths made absolute (a rank on another
    node starts in its home directory)."""
    from bigtrain.models.hub import is_hub_name
    out = ["--mode", args.mode, args.target if is_hub_name(args.target) else os.path.abspath(args.target), "--zero3"]
    for flag in ("revision", "tag", "tokenizer", "max_new_tokens", "do_sample", "temperature", "top_p", "top_k",
                 "min_p", "repetition_penalty", "num_beams", "seed", "system"):
        value = getattr(args, flag)
        if value is not None:
            out += ["--" + flag.replace("_", "-"), str(value).lower() if isinstance(value, bool) else str(value)]
    for prompt in args.prompt:
        out += ["--prompt", prompt]
    if args.prompts_file:
        out += ["--prompts-file", os.path.abspath(args.prompts_file)]
    if args.out:
        out += ["--out", os.path.abspath(args.out)]
    return out + [flag for flag, on in (("--raw", args.raw), ("--trust-checkpoint", args.trust_checkpoint)) if on]
