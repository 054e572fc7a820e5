"""Building the plain module, partitioned from birth under ZeRO-3.

Inside `deepspeed.zero.Init` every submodule's parameters are split across the ranks as
soon as that submodule is constructed, so no rank ever holds the whole model. Our own
families initialise weights in each module's `__init__` or through `Module.apply`, both of
which zero.Init handles. transformers models need more: they initialise weights after
construction, which transformers does correctly under ZeRO-3 (gathering each module's
shards first) only when it knows ZeRO-3 is on, i.e. while an `HfDeepSpeedConfig` object is
alive. That object also makes `from_pretrained` load a local checkpoint straight into
the partitioned parameters.
"""
from __future__ import annotations

import deepspeed
from torch import nn
from transformers.integrations import HfDeepSpeedConfig

from bigtrain.models.spec import ModelSpec


def build_module(spec: ModelSpec, zero3_init_config: dict | None = None) -> nn.Module:
    """spec.build(), inside `deepspeed.zero.Init(config_dict_or_path=zero3_init_config)` when given.

    `zero3_init_config` is the run's resolved DeepSpeed config (ZeRO stage 3); its dtype
    (bf16/fp16) and `offload_param` device decide where and how the shards live.
    """
    if zero3_init_config is None:
        return spec.build()
    stage = zero3_init_config.get("zero_optimization", {}).get("stage")
    if stage != 3:
        raise ValueError(f"zero3_init_config has zero_optimization.stage={stage!r}; zero.Init needs stage 3 "
                         "(pass None to build the module unpartitioned)")
    # transformers holds only a weak reference: the module keeps it alive for later calls
    # (from_pretrained, resize_token_embeddings, generate) that must also see ZeRO-3.
    hf_ds_config = HfDeepSpeedConfig(zero3_init_config)
    with deepspeed.zero.Init(config_dict_or_path=zero3_init_config):
        module = spec.build()
    module.bigtrain_hf_ds_config = hf_ds_config
    return module
