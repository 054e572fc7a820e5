"""Reference 2: a plain PyTorch DDP loop (torch AdamW, gradient clipping at 1.0, autocast for bf16).

Same model, data, batch and optimizer settings as the DeepSpeed runs (at a constant learning
rate: a schedule costs nothing). fp32 weights with bf16 autocast is PyTorch's own mixed
precision; DeepSpeed's bf16 keeps bf16 weights and fp32 master copies instead.

    deepspeed --num_gpus 2 --module bigtrain.bench.baseline_ddp --job job.json --out DIR
"""
from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from bigtrain.bench import baseline
from bigtrain.bench.baseline import Trainer


def wrap(job: dict, ds_config: dict | None = None) -> Trainer:
    """The model in DDP (at any world size, one rank included), torch's AdamW, the plain step uncompiled."""
    device = baseline.torch_process_group()
    spec = baseline.seeded_spec(job)
    model = DistributedDataParallel(spec.build().to(device))
    optimizer = torch.optim.AdamW(model.parameters(), **baseline.adamw_kwargs(job["optimizer"]))
    return baseline.torch_trainer(job, spec, model.module, model, optimizer, device, {"runner": "ddp"})


if __name__ == "__main__":
    baseline.leave(baseline.main(__doc__, wrap))
