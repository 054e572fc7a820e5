"""`bigtrain eval --zero3` (and `bigtrain generate` / `chat --zero3`): a model too large for one device, held as
ZeRO-3 partitions over the ranks.

Rank 0 alone consolidates the model in host memory (as for any `bigtrain eval`); every rank then builds the same
architecture under ZeRO-3 (transformers' `from_config` inside `deepspeed.zero.Init`: each rank's device holds 1/N
of every weight, fp32 as consolidated) and rank 0 hands the weights over one parameter at a time (each gathered,
written by rank 0, partitioned again). DeepSpeed's engine then gathers each layer's weights inside every forward
pass, as in training, so every rank takes part in every pass: the ranks run the same requests in lockstep (no
request split).
"""
from __future__ import annotations

from typing import Any

import torch

from bigtrain.distributed.world import World
from bigtrain.eval.target import Target

ZERO3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}


def zero3_target(full: Target | None, world: World) -> Target:
    """The model of `full` (rank 0's; None on the other ranks) partitioned over all ranks, on every rank."""
    import deepspeed
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.integrations.deepspeed import HfDeepSpeedConfig

    from bigtrain.export.write import no_init

    shared: list[Any] = ([full.model.config, full.tokenizer, full.description, full.default_out, full.processor,
                          full.prompts] if full else [None] * 6)
    torch.distributed.broadcast_object_list(shared, src=0)  # the architecture and tokenizer, not the weights
    config, tokenizer, description, default_out, processor, prompts = shared
    hf_config = HfDeepSpeedConfig(ZERO3)  # while it lives, transformers builds models inside zero.Init
    with no_init():  # every weight is overwritten below: a large model's random init would take minutes
        model = (AutoModelForImageTextToText if processor is not None else AutoModelForCausalLM).from_config(config)
    weights = dict(full.model.named_parameters()) if full else {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if world.is_main:
                    param.copy_(weights[name])
    del weights
    engine, *_ = deepspeed.initialize(model=model, config=ZERO3)  # the hooks that gather each layer's weights
    module = engine.module.eval()
    module.bigtrain_hf_ds_config = hf_config  # transformers keeps only a weak reference to it
    return Target(module, tokenizer, f"{description}, as ZeRO-3 partitions over {world.size} ranks", default_out,
                  full.checkpoint if full else None, processor, prompts)


def held_target(path: str, tag: str | None, tokenizer: str | None, trust_checkpoint: bool, revision: str | None,
                world: World, zero3: bool) -> Target:
    """The model at `path` as every rank holds it: whole on each rank's device, or (`zero3`) consolidated by rank 0
    alone and partitioned over all ranks (`zero3_target`). A Hub name is fetched once per node."""
    from bigtrain.eval.target import load_target
    if zero3:  # rank 0 consolidates; every rank holds 1/N of each weight on its device
        full = load_target(path, tag, tokenizer, trust_checkpoint, revision) if world.is_main else None
        return zero3_target(full, world)
    from deepspeed.accelerator import get_accelerator
    target = load_target(path, tag, tokenizer, trust_checkpoint, revision, world)
    target.model.to(get_accelerator().current_device_name())
    return target
