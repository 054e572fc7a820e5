"""The flags of `bigtrain generate` and `bigtrain chat` that every rank reads, and the parser of a launched rank
(`python -m bigtrain.generate --mode generate|chat ...`)."""
from __future__ import annotations

import argparse

from bigtrain.config.flags import FlagParser
from bigtrain.generate.sampling import add_sampling_args
from bigtrain.generate.tool_use import add_tool_args

TARGET_HELP = ("TARGET is a run folder (its newest complete checkpoint, or --tag, consolidated in memory; a LoRA run "
               "with its adapters merged), a Hugging Face model directory (a `bigtrain export`, any local causal LM), "
               "a peft adapter directory (on its base, merged), or a Hugging Face Hub name (org/name, --revision; "
               "downloaded once into the HF cache). A chat model's prompts go through its tokenizer's chat template "
               "(--raw: plain text). Sampling flags are transformers' GenerationConfig fields; unset ones come from "
               "the model's generation_config.json.")


def add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", help="run folder, model directory, adapter directory or Hub name (org/name)")
    p.add_argument("--revision", default=None, help="a Hub TARGET's branch, tag or commit (default main)")
    p.add_argument("--tag", default=None, help="run folder: the checkpoint, e.g. step_000120 (default: the newest)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer dir or Hub name (default: the run's, or the model directory's)")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="unpickle any type in the checkpoint's files (only for checkpoints you trust)")
    p.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image a vision-language model reads with each prompt (chat: with the first question), "
                        "placed before its text (repeatable)")
    p.add_argument("--zero3", action="store_true",
                   help="a model too large for one device: hold it as ZeRO-3 partitions over the ranks (rank 0 "
                        "consolidates it in host memory); every rank runs every forward pass. Needs --num-gpus N > 1")
    add_sampling_args(p)
    add_tool_args(p)


def add_generate_args(p: argparse.ArgumentParser) -> None:
    add_target_args(p)
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", default=None, metavar="FILE",
                   help="prompts: a text file (one a line) or JSON lines of {\"prompt\": ...} or {\"messages\": [...]}")
    p.add_argument("--out", default=None, metavar="FILE.jsonl",
                   help="also write {\"prompt\", \"completion\"} a line to this file")


def build_rank_parser() -> argparse.ArgumentParser:
    """A launched rank's flags: --mode generate|chat (the verb), then that verb's (the launcher puts its
    --local_rank first, so the verb is a flag, not a subcommand)."""
    p = FlagParser(prog="python -m bigtrain.generate", description=TARGET_HELP)
    p.add_argument("--mode", choices=("generate", "chat"), required=True, help="the verb the ranks run")
    add_generate_args(p)  # chat's flags are generate's but the prompts
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # the DeepSpeed launcher's
    p.add_argument("--verbose", action="store_true", help="DeepSpeed's and torch's own lines too")
    return p
