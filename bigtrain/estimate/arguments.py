"""`bigtrain estimate`'s command line: the memory table for a model from the zoo, and the fastest setup that fits.

    bigtrain estimate --model gpt2 --size xl --num-gpus 8 --num-nodes 2 --gpu-mem 80
    bigtrain estimate --model gpt2 --set model.pretrained=./my-gpt2 --gpu-mem 24GiB
    bigtrain estimate --model llama --size 1b --num-gpus 2 --set lora.r=16   # LoRA: adapters train
    bigtrain estimate --config run.yaml --set model.overrides.n_layer=24 --gpu-mem 80

The model and the batch are read from the run config, as `bigtrain train` reads them (`--config`, `--set
section.field=VALUE`, and the same shorthand flags: --model, --size); --seq-len, --micro-batch, --precision,
--tensor, --sequence, --expert, --lora-r and --pretrained are shorthands for data.seq_len, batch.micro_batch,
precision, parallel.tensor, parallel.sequence, parallel.expert, lora.r and model.pretrained. The machine (--num-gpus,
--num-nodes, --gpu-mem, --cpu-mem, --headroom) and the levers it tabulates (--optimizer, --tiled-mlp,
--offload-hidden-states) are the estimate's own.

The estimate itself: bigtrain/estimate/cli.py.
"""
from __future__ import annotations

import argparse

from bigtrain.config.flags import FAMILY_HELP, add_run_config_args
from bigtrain.estimate.memory_model import PRECISIONS


def add_estimate_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `bigtrain estimate` on the CLI's subparsers."""
    p = subparsers.add_parser("estimate", help="per-rank memory for each ZeRO stage x offload x checkpointing",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_config_args(p)
    p.add_argument("--model", default=None, help=f"{FAMILY_HELP} (model.family)")
    p.add_argument("--size", default=None, help="named size (see `bigtrain models`), or custom with "
                                                "--set model.overrides.KEY=VALUE (model.size)")
    p.add_argument("--pretrained", default=None, metavar="DIR",
                   help="a Hugging Face model directory or Hub name (org/name): its config.json gives the shape, no "
                        "weights read or downloaded (model.pretrained)")
    p.add_argument("--num-gpus", type=_positive_int, default=None,
                   help="GPUs (ranks) per node (default 8, an assumption the first line says)")
    p.add_argument("--num-nodes", type=_positive_int, default=1, help="nodes (default 1)")
    p.add_argument("--gpu-mem", default=None,
                   help="memory per GPU: 80 or 80GB (10^9 bytes), 80GiB or 80G (2^30); default 80GiB, an assumption "
                        "the first line says")
    p.add_argument("--cpu-mem", default=None, help="host memory per node, checked for offload (e.g. 512 = 512 GB, 512GiB)")
    p.add_argument("--micro-batch", type=_positive_int, default=None,
                   help="samples per forward per rank (batch.micro_batch; default 1)")
    p.add_argument("--seq-len", type=_positive_int, default=None,
                   help="tokens per sample, token models (data.seq_len; default the model's)")
    p.add_argument("--precision", choices=sorted(PRECISIONS), default=None,
                   help="training precision (precision; default bf16)")
    p.add_argument("--tensor", type=_positive_int, default=None,
                   help="tensor-parallel ranks per layer (parallel.tensor; default 1)")
    p.add_argument("--sequence", type=_positive_int, default=None,
                   help="sequence-parallel ranks per sample (parallel.sequence; default 1)")
    p.add_argument("--expert", type=_positive_int, default=None,
                   help="expert-parallel ranks (parallel.expert, DeepSpeed AutoEP; default 1)")
    p.add_argument("--tiled-mlp", choices=("auto", "true", "false"), default="auto",
                   help="ALST's tiled MLP (activation_checkpointing.tiled_mlp): auto = on when the tokens per rank "
                        "reach 4 x the hidden size, as training decides (default auto)")
    p.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                   help="optimizer.name: muon keeps one fp32 momentum per matrix it trains, Adam two moments")
    p.add_argument("--offload-hidden-states", choices=("auto", "true", "false"), default="auto",
                   help="ALST: checkpointed hidden states in host memory (activation_checkpointing."
                        "offload_hidden_states), counted in the +ckpt setups; auto as training decides on a GPU")
    p.add_argument("--lora-r", "--lora_r", dest="lora_r", type=_non_negative_int, default=None,
                   help="LoRA rank (lora.r): adapters on every linear layer of the decoder train, the base is frozen, "
                        "so gradients and optimizer states are the adapters' only (default 0: every weight trains)")
    p.add_argument("--headroom", type=float, default=0.1,
                   help="fraction of --gpu-mem kept free for the CUDA context and fragmentation (default 0.1)")
    p.set_defaults(func=_run_estimate)


def _run_estimate(args: argparse.Namespace) -> int:
    from bigtrain.estimate.cli import run_estimate  # the estimate's modules load only for the command itself
    return run_estimate(args)


def _non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def _positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def _int_at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= {least}")
    return value
