"""Building the plain module, partitioned from birth under ZeRO-3, with the same initial weights
as every other build path.

Inside `deepspeed.zero.Init` every submodule's parameters are split across the ranks as
soon as that submodule is constructed, so no rank ever holds the whole model. The weights
are then initialised by `ModelSpec.initialize` (seeded by each module's name, see
`bigtrain.models.init`): each module's shards are gathered, rank 0 draws the values, and
the gather context spreads them, one module at a time. transformers must know ZeRO-3 is on
while an `HfDeepSpeedConfig` object is alive: `from_pretrained` then loads a local checkpoint
straight into the partitioned parameters (no rank materialises the whole model).
"""
from __future__ import annotations

import contextlib

import deepspeed
from deepspeed import comm as dist
from torch import nn
from transformers.integrations import HfDeepSpeedConfig
from transformers.integrations.deepspeed import prevent_arange_dtype_change

from bigtrain.models.init import seed_from_global_rng, untouched_global_rng
from bigtrain.models.spec import ModelSpec


def _gathered(params: list[nn.Parameter]) -> contextlib.AbstractContextManager:
    return deepspeed.zero.GatheredParameters(params, modifier_rank=0)


def _for_nested_init(ds_config: dict, mpu: object) -> dict:
    """The config transformers sees while `from_pretrained` loads into our partitioned module. Its own zero.Init
    (nested in ours, which does the partitioning) gets no `mpu`, so DeepSpeed checks the batch against every rank,
    not the data-parallel ones: a tensor-parallel run gives it the batch that holds there. And transformers refuses
    its checkpoint-key conversions (every Llama directory has some) when the config names AutoTP, meant for its
    inference path; here the weights are loaded whole and DeepSpeed splits them later, in `initialize`."""
    if mpu is None:
        return ds_config
    world = dist.get_world_size()
    loading = {k: v for k, v in ds_config.items() if k != "tensor_parallel"}
    return {**loading, "train_batch_size": ds_config["train_micro_batch_size_per_gpu"]
            * ds_config.get("gradient_accumulation_steps", 1) * world}


def build_module(spec: ModelSpec, zero3_init_config: dict | None = None, seed: int | None = None,
                 mpu: object = None) -> nn.Module:
    """`spec.build(seed)`, partitioned inside `deepspeed.zero.Init(config_dict_or_path=zero3_init_config)` when given.

    `zero3_init_config` is the run's resolved DeepSpeed config (ZeRO stage 3); its dtype
    (bf16/fp16) and `offload_param` device decide where and how the shards live. The initial
    weights equal `spec.build(seed)`'s (needs the process group under ZeRO-3). `mpu`: the tensor-parallel
    groups (`bigtrain.parallel.split`), so that zero.Init counts the data-parallel ranks as the engine does.
    """
    if zero3_init_config is None:
        return spec.build(seed)
    stage = zero3_init_config.get("zero_optimization", {}).get("stage")
    if stage != 3:
        raise ValueError(f"zero3_init_config has zero_optimization.stage={stage!r}; zero.Init needs stage 3 "
                         "(pass None to build the module unpartitioned)")
    seed = seed_from_global_rng() if seed is None else seed
    # transformers holds only a weak reference: the module keeps it alive for later calls
    # (from_pretrained, resize_token_embeddings, generate) that must also see ZeRO-3.
    hf_ds_config = HfDeepSpeedConfig(_for_nested_init(zero3_init_config, mpu))
    # prevent_arange_dtype_change: zero.Init would build rotary frequencies (arange) in bf16.
    with untouched_global_rng(), prevent_arange_dtype_change(), deepspeed.zero.Init(config_dict_or_path=zero3_init_config, mpu=mpu):
        module = spec.construct()
    spec.initialize(module, seed, gather=_gathered, writer=dist.get_rank() == 0)
    module.bigtrain_hf_ds_config = hf_ds_config
    return module
