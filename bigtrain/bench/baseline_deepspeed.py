"""Reference 1: the minimal hand-written `deepspeed.initialize` loop bigtrain must not be slower than.

Same model, data, batch and DeepSpeed config (the JSON bigtrain is given); no bigtrain runner code.

    deepspeed --num_gpus 2 --module bigtrain.bench.baseline_deepspeed --job job.json --ds-config ds.json --out DIR
"""
from __future__ import annotations

from typing import Any

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from transformers.integrations import HfDeepSpeedConfig

from bigtrain.bench import baseline
from bigtrain.bench.baseline import Trainer
from bigtrain.metrics import memory_report
from bigtrain.models.init import seed_from_global_rng

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _gathered(params: list[torch.nn.Parameter]) -> Any:
    return deepspeed.zero.GatheredParameters(params, modifier_rank=0)


def wrap(job: dict, ds_config: dict | None) -> Trainer:
    """The model built under zero.Init where ZeRO-3 asks for it, in `deepspeed.initialize`'s engine; the engine
    steps after every micro-batch and applies the update at its accumulation boundary."""
    assert ds_config is not None, "the deepspeed baseline is launched with --ds-config"
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    spec = baseline.seeded_spec(job)
    zero3 = ds_config["zero_optimization"]["stage"] == 3
    hf_zero3 = HfDeepSpeedConfig(ds_config) if zero3 else None  # lets transformers init under ZeRO-3
    seed = seed_from_global_rng()  # as spec.build() draws it: the same initial weights as every runner
    with deepspeed.zero.Init(config_dict_or_path=ds_config, enabled=zero3):
        model = spec.construct()
    # Under ZeRO-3 each rank holds a shard only: the init gathers a module's parameters, rank 0 draws them
    # and the gather spreads them (what transformers' own init does under zero.Init).
    spec.initialize(model, seed, gather=_gathered if zero3 else None,
                    writer=not zero3 or torch.distributed.get_rank() == 0)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    def micro_step(inputs: Any, labels: torch.Tensor) -> torch.Tensor:
        loss = spec.loss(engine(inputs), labels)
        engine.backward(loss)
        engine.step()
        return loss
    return Trainer(spec, engine.device, DTYPES[job["precision"]], engine.train_micro_batch_size_per_gpu(),
                   engine.gradient_accumulation_steps(), engine.train_batch_size(), micro_step,
                   lambda: memory_report(engine), {"runner": "deepspeed"}, hold=(hf_zero3,))


if __name__ == "__main__":
    baseline.leave(baseline.main(__doc__, wrap, takes_ds_config=True))
