"""Reference 1: the minimal hand-written `deepspeed.initialize` loop bigtrain must not be slower than.

Same model, data, batch and DeepSpeed config (the JSON bigtrain is given); no bigtrain runner code.

    deepspeed --num_gpus 2 --module bigtrain.bench.baseline_deepspeed --job job.json --ds-config ds.json --out DIR
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from transformers.integrations import HfDeepSpeedConfig

from bigtrain import models
from bigtrain.bench.baseline_common import (StepClock, load_job, same_rank_setup, synthetic_batches, to_device,
                                            write_result)
from bigtrain.metrics import memory_report

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--job", required=True)
    p.add_argument("--ds-config", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    job, ds_config = load_job(args.job), json.loads(Path(args.ds_config).read_text())

    same_rank_setup()
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(job["seed"])
    spec = models.build(job["family"], job["size"], **job["spec_kwargs"])
    zero3 = ds_config["zero_optimization"]["stage"] == 3
    hf_zero3 = HfDeepSpeedConfig(ds_config) if zero3 else None  # noqa: F841 -- lets transformers init under ZeRO-3
    with deepspeed.zero.Init(config_dict_or_path=ds_config, enabled=zero3):
        model = spec.build()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    device, dtype = engine.device, DTYPES[job["precision"]]

    data = synthetic_batches(job, rank, world, engine.train_micro_batch_size_per_gpu())
    clock, losses = StepClock(), []
    for _ in range(job["steps"]):
        for _ in range(engine.gradient_accumulation_steps()):
            inputs, labels = spec.batch_to_inputs(next(data))
            loss = spec.loss(engine(to_device(inputs, device, dtype)), labels.to(device))
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
        clock.tick()

    write_result(args.out, rank, clock, engine.train_batch_size(), losses, spec, memory_report(engine),
                 {"runner": "deepspeed"})
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Both ranks' results are on disk. Skip the interpreter's teardown: with ZeRO-3 it sometimes
    # aborts ("terminate called without an active exception") and the launcher then reports a
    # failed job for a run that measured everything.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
