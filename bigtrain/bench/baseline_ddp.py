"""Reference 2: a plain PyTorch DDP loop (torch AdamW, gradient clipping at 1.0, autocast for bf16).

Same model, data, batch and optimizer settings as the DeepSpeed runs (at a constant learning
rate: a schedule costs nothing). fp32 weights with bf16 autocast is PyTorch's own mixed
precision; DeepSpeed's bf16 keeps bf16 weights and fp32 master copies instead.

    deepspeed --num_gpus 2 --module bigtrain.bench.baseline_ddp --job job.json --out DIR
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from deepspeed.accelerator import get_accelerator
from torch.nn.parallel import DistributedDataParallel

from bigtrain import models
from bigtrain.bench.baseline_common import (StepClock, load_job, same_rank_setup, synthetic_batches, to_device,
                                            write_result)
from bigtrain.metrics import memory_report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--job", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    job = load_job(args.job)

    same_rank_setup()
    acc = get_accelerator()
    # The launcher set RANK, WORLD_SIZE, MASTER_ADDR/PORT.
    torch.distributed.init_process_group(acc.communication_backend_name())
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    device = torch.device(acc.device_name(int(os.environ.get("LOCAL_RANK", "0"))))
    if device.type != "cpu":
        acc.set_device(device.index)
    torch.manual_seed(job["seed"])
    spec = models.build(job["family"], job["size"], **job["spec_kwargs"])
    model = DistributedDataParallel(spec.build().to(device))
    opt = job["optimizer"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt["lr"], betas=tuple(opt["betas"]), eps=opt["eps"],
                                  weight_decay=opt["weight_decay"])
    bf16 = job["precision"] == "bf16"

    data = synthetic_batches(job, rank, world, job["micro_batch"])
    clock, losses = StepClock(), []
    for _ in range(job["steps"]):
        inputs, labels = spec.batch_to_inputs(next(data))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = spec.loss(model(to_device(inputs, device, torch.float32)), labels.to(device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), job["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        clock.tick()

    write_result(args.out, rank, clock, job["micro_batch"] * world, losses, spec,
                 memory_report(model.module, optimizer), {"runner": "ddp"})
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # results written; skip the teardown that sometimes aborts (see baseline_deepspeed)
