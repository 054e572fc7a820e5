"""The flags of `bigtrain eval` that every rank reads, and the parser of a launched rank (`python -m bigtrain.eval`)."""
from __future__ import annotations

import argparse

from bigtrain.config.flags import FlagParser

EPILOG = """TARGET is a run folder (its newest complete checkpoint, or --tag, consolidated in memory; a LoRA run
with its adapters merged), a Hugging Face model directory (a `bigtrain export`, any local causal LM, a peft
adapter directory) or a Hugging Face Hub name (org/name, --revision; downloaded once per node into the HF cache). Tasks are lm-eval's (their data from the Hugging Face cache or hub) or your own: a folder of
task YAML files given with --include-path (dataset_path: json, data_files: your files; docs/evaluation.md).
With --num-gpus N the forward passes are split over N ranks, which give exactly the numbers one rank gives."""


def add_eval_args(p: argparse.ArgumentParser) -> None:
    """The flags every rank reads (the verb's own launch flags are added by `add_eval_parser`)."""
    p.add_argument("target", help="run folder (--out of a run, its checkpoints/ or a step_NNNNNN dir), model dir, "
                                  "or a Hugging Face Hub name (org/name)")
    p.add_argument("--revision", default=None,
                   help="a Hub TARGET's branch, tag or commit (default main)")
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
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer dir or Hub name (default: the run's, or the model directory's)")
    p.add_argument("--zero3", action="store_true",
                   help="a model too large for one device: hold it as ZeRO-3 partitions over the ranks (1/N of each "
                        "weight per device; rank 0 consolidates it in host memory); every rank then runs every "
                        "forward pass. Needs --num-gpus N > 1 or --hostfile")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="unpickle any type in the checkpoint's files (only for checkpoints you trust)")


def build_rank_parser() -> argparse.ArgumentParser:
    p = FlagParser(prog="python -m bigtrain.eval", description=EPILOG,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    add_eval_args(p)
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # the DeepSpeed launcher's
    p.add_argument("--verbose", action="store_true", help="DeepSpeed's and torch's own lines too")
    return p


def _limit(text: str) -> float | int:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text}: give a number of documents (> 0) or a fraction in (0, 1)")
    return int(value) if value >= 1 and value == int(value) else value
