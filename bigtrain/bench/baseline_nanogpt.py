"""Reference 3: a nanoGPT-style plain PyTorch loop, what a careful user writes without DeepSpeed.

As nanoGPT's train.py does it: fp32 weights under bf16 autocast, the loss computed with the model in
one `torch.compile`d function, SDPA attention (the model bigtrain builds uses it), fused AdamW where
torch has it for the device, TF32 allowed for the fp32 matmuls that are left, gradient clipping, DDP
over more than one rank. Same model, data, batch and optimizer settings as the other runners, at a
constant learning rate. `torch.compile` follows bigtrain's own default: on on GPUs, off on a CPU
(the job's "compile" key overrides).

    deepspeed --num_gpus 1 --module bigtrain.bench.baseline_nanogpt --job job.json --out DIR
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

import torch
from deepspeed.accelerator import get_accelerator
from torch.nn.parallel import DistributedDataParallel

from bigtrain import models
from bigtrain.bench.baseline_common import (StepClock, load_job, same_rank_setup, synthetic_batches, to_device,
                                            write_result)
from bigtrain.metrics import memory_report


def fused_adamw(params: Any, opt: dict, device: torch.device) -> tuple[torch.optim.Optimizer, bool]:
    """torch's AdamW with `fused=True` where the device has the kernel (nanoGPT's choice), else the default."""
    kwargs = dict(lr=opt["lr"], betas=tuple(opt["betas"]), eps=opt["eps"], weight_decay=opt["weight_decay"])
    params = list(params)
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs), True
    except (RuntimeError, ValueError, TypeError):  # no fused kernel for this device or dtype
        return torch.optim.AdamW(params, **kwargs), False


def loss_fn(model: torch.nn.Module, spec: Any, compile_it: bool) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """(inputs, labels) -> loss: forward and loss in one function, compiled together when asked."""
    def step_loss(inputs: Any, labels: torch.Tensor) -> torch.Tensor:
        return spec.loss(model(inputs), labels)
    return torch.compile(step_loss) if compile_it else step_loss


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--job", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    job = load_job(args.job)

    same_rank_setup()
    acc = get_accelerator()
    torch.distributed.init_process_group(acc.communication_backend_name())  # the launcher set RANK, WORLD_SIZE, ...
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    device = torch.device(acc.device_name(int(os.environ.get("LOCAL_RANK", "0"))))
    if device.type != "cpu":
        acc.set_device(device.index)
    torch.backends.cuda.matmul.allow_tf32 = True  # nanoGPT's setting; bf16 autocast covers the large matmuls
    torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(job["seed"])
    spec = models.build(job["family"], job["size"], **job["spec_kwargs"])
    raw = spec.build().to(device)
    model = DistributedDataParallel(raw) if world > 1 else raw
    optimizer, fused = fused_adamw(raw.parameters(), job["optimizer"], device)
    compile_it = job.get("compile")
    compile_it = device.type != "cpu" if compile_it is None else bool(compile_it)
    step_loss = loss_fn(model, spec, compile_it)
    bf16 = job["precision"] == "bf16"

    data = synthetic_batches(job, rank, world, job["micro_batch"])
    clock, losses = StepClock(), []
    for _ in range(job["steps"]):
        inputs, labels = spec.batch_to_inputs(next(data))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = step_loss(to_device(inputs, device, torch.float32), labels.to(device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(raw.parameters(), job["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # one host sync per step, as nanoGPT's logging does
        clock.tick()

    write_result(args.out, rank, clock, job["micro_batch"] * world, losses, spec, memory_report(raw, optimizer),
                 {"runner": "nanogpt", "compiled": compile_it, "fused_adamw": fused})
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # results written; skip the teardown that sometimes aborts (see baseline_deepspeed)
