"""Part of models_dist_checks.py: activation checkpointing through a *configured*
`deepspeed.checkpointing` (partitioned activations copied to CPU, from a DeepSpeed
config's `activation_checkpointing` section).

For every family at a tiny size (with dropout where the family has it) `check()` returns
the largest gradient and buffer difference against the same step without checkpointing.
"""
from __future__ import annotations

import copy

import deepspeed
import torch

from bigtrain.models import build
from bigtrain.parallel import apply_activation_checkpointing

DS_CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
             "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True}}

CASES = [
    ("gpt2", {"vocab_size": 256, "dropout": 0.1},
     lambda g: (lambda x: (x, x))(torch.randint(0, 256, (2, 16), generator=g))),
    ("encoder", {"vocab_size": 256, "n_positions": 32, "dropout": 0.1},
     lambda g: (torch.randint(0, 256, (2, 16), generator=g), torch.tensor([0, 1]))),
    ("resnet", {}, lambda g: (torch.randn(2, 3, 32, 32, generator=g), torch.tensor([3, 5]))),
]


def step(spec, module, inputs, labels) -> tuple[float, dict, dict]:
    torch.manual_seed(1)  # same dropout masks in both runs
    loss = spec.loss(module(inputs), labels)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in module.named_parameters()}, dict(module.named_buffers())


def check() -> dict:
    report = {}
    for family, overrides, make in CASES:
        spec = build(family, "tiny", **overrides)
        torch.manual_seed(0)
        plain = spec.build().train()
        wrapped = copy.deepcopy(plain)
        count = apply_activation_checkpointing(spec, wrapped, ds_config=DS_CONFIG)
        inputs, labels = make(torch.Generator().manual_seed(2))
        loss_a, grads_a, bufs_a = step(spec, plain, inputs, labels)
        loss_b, grads_b, bufs_b = step(spec, wrapped, inputs, labels)
        report[family] = {
            "blocks": count, "loss": loss_a, "loss_diff": abs(loss_a - loss_b),
            "grad_diff": max((grads_a[n] - grads_b[n]).abs().max().item() for n in grads_a),
            "buffer_diff": max([(bufs_a[n].float() - bufs_b[n].float()).abs().max().item() for n in bufs_a] or [0.0]),
            "partition_activations": deepspeed.checkpointing.is_configured()
            and deepspeed.runtime.activation_checkpointing.checkpointing.PARTITION_ACTIVATIONS,
        }
    return report
