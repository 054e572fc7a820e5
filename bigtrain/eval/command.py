"""`bigtrain eval` in one process, which is one rank of many when a launcher started it (`python -m bigtrain.eval`).

Every rank loads the whole model (consolidated in memory from a run folder, or read from a directory) and the
tasks; the forward passes are split over the ranks (`RankSplitLM`), every rank ends with the same results, and
rank 0 writes the results file and prints lm-eval's table.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from bigtrain.distributed.world import World


def vision_line(target: str) -> str:
    return (f"{target} is a vision-language model: bigtrain eval runs lm-eval's text tasks through its causal-LM "
            "model, and lm-eval scores images through its own hf-multimodal model, which bigtrain eval does not "
            "drive: export the run (bigtrain export) and run lm_eval --model hf-multimodal --model_args "
            "pretrained=EXPORT --tasks mmmu_val")


def run_eval(args: argparse.Namespace, world: World) -> int:
    """Evaluate `args.target` on `args.tasks` as rank `world.rank` of `world.size`; 0 when done (ValueError, one
    line, for a user's mistake)."""
    from bigtrain.eval.tasks import load_tasks, task_manager
    names = check_eval_args(args)
    manager = task_manager(args.include_path, names)
    tasks = load_tasks(names, manager)  # before the model: a wrong name or missing data costs no loading
    from bigtrain.eval.partitioned import held_target
    target = held_target(args.target, args.tag, args.tokenizer, args.trust_checkpoint, args.revision, world, args.zero3)
    if target.processor is not None:  # a Hub name's, known once loaded
        raise ValueError(vision_line(args.target))

    from bigtrain.eval.lm import RankSplitLM
    from bigtrain.eval.runner import evaluate, results_table, write_results
    progress = world.is_main and sys.stderr.isatty()
    lm = RankSplitLM(target.model, target.tokenizer, args.batch_size, rank=world.rank, world=world.size,
                     split=not args.zero3, progress=progress)  # ZeRO-3: every rank in every forward pass
    results = evaluate(lm, tasks, num_fewshot=args.num_fewshot, limit=args.limit, progress=progress)
    if world.is_main:
        results["bigtrain"].update(target=target.description, ranks=world.size, batch_size=args.batch_size,
                                   zero3=args.zero3)
        out = write_results(results, args.out or target.default_out)
        info = results["bigtrain"]
        requests = sum(info["requests"].values())
        print(results_table(results))
        print(f"evaluated {target.description} on {', '.join(names)} with {world.size} rank(s): {requests} requests "
              f"in {info['seconds']:.1f} s ({info['requests_per_s']:.1f} requests/s); results: {out}")
    return 0


def check_eval_args(args: argparse.Namespace) -> list[str]:
    """The task names; ValueError (one line) for a target that is no run or model directory, or a task name no task
    file defines: in seconds, before the model is loaded, lm-eval's tasks indexed, or (`bigtrain eval --num-gpus N`)
    any rank started."""
    from bigtrain.eval.target import target_kind, vision_target
    from bigtrain.eval.tasks import check_task_names, split_names
    target_kind(args.target, args.tag, args.revision)  # a wrong path: one line before anything is imported
    if vision_target(args.target, args.tag):  # known from its files, whether or not lm-eval is installed
        raise ValueError(vision_line(args.target))
    names = split_names(args.tasks)
    check_task_names(names, args.include_path)
    return names


def rank_main(argv: list[str] | None = None) -> int:
    """The entry of each launched rank: the process group (or a world of one), `run_eval`, an orderly end."""
    from bigtrain.eval.flags import build_rank_parser
    from bigtrain.metrics.logs import quiet_hf_progress_bars, route_library_logs
    args = build_rank_parser().parse_args(argv)
    route_library_logs(verbose=args.verbose, console=sys.stderr)
    quiet_hf_progress_bars()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from bigtrain.distributed.world import init_distributed, shutdown
        world = init_distributed()
    else:
        world, shutdown = World(0, 0, 1), None
    try:
        code = run_eval(args, world)
    except ValueError as err:  # every rank meets the same mistake; rank 0 says it
        if world.is_main:
            print(f"bigtrain eval: {err}", file=sys.stderr, flush=True)
        return 2
    if shutdown is not None:
        shutdown()
    return code

