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

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from bigtrain.bench import baseline
from bigtrain.bench.baseline import Trainer


def fused_adamw(params: Any, opt: dict, device: torch.device) -> tuple[torch.optim.Optimizer, bool]:
    """torch's AdamW with `fused=True` where the device has the kernel (nanoGPT's choice), else the default."""
    kwargs = baseline.adamw_kwargs(opt)
    params = list(params)
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs), True
    except (RuntimeError, ValueError, TypeError):  # no fused kernel for this device or dtype
        return torch.optim.AdamW(params, **kwargs), False


def wrap(job: dict, ds_config: dict | None = None) -> Trainer:
    """TF32 on, DDP only over more than one rank, fused AdamW, forward and loss compiled on GPUs; the plain step."""
    device = baseline.torch_process_group()
    torch.backends.cuda.matmul.allow_tf32 = True  # nanoGPT's setting; bf16 autocast covers the large matmuls
    torch.backends.cudnn.allow_tf32 = True
    spec = baseline.seeded_spec(job)
    raw = spec.build().to(device)
    model = DistributedDataParallel(raw) if torch.distributed.get_world_size() > 1 else raw
    optimizer, fused = fused_adamw(raw.parameters(), job["optimizer"], device)
    compile_it = job.get("compile")
    compile_it = device.type != "cpu" if compile_it is None else bool(compile_it)
    return baseline.torch_trainer(job, spec, raw, model, optimizer, device,
                                  {"runner": "nanogpt", "compiled": compile_it, "fused_adamw": fused}, compile_it)


if __name__ == "__main__":
    baseline.leave(baseline.main(__doc__, wrap))
