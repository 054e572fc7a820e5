"""Run by tests/test_parallel.py through `deepspeed --num_gpus 2`: GPT-2 built inside zero.Init.

Usage: models_zero3_init.py OUT_DIR PRETRAINED_DIR
Rank 0 first saves a tiny GPT-2 (seed 0) to PRETRAINED_DIR with save_pretrained. Each rank then
builds (a) GPT-2 tiny from its config and (b) the saved one via `pretrained=`, both through
`bigtrain.parallel.build_module` under ZeRO-3, and writes OUT_DIR/rank{R}.json with what it
holds locally and what the gathered weights look like. The test asserts on those numbers.
"""
from __future__ import annotations

import json
import os
import sys

import deepspeed
import torch
from deepspeed import comm as dist

from bigtrain.models import build
from bigtrain.parallel import build_module

VOCAB = 512


def ds_config(world: int) -> dict:
    return {"train_batch_size": world, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}


def partition_report(model: torch.nn.Module) -> dict:
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params):
        gathered = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {
        "local_numel": sum(p.ds_tensor.numel() for p in params),
        "total_numel": sum(p.ds_numel for p in params),
        "num_tensors": len(params),
        "max_local_param_numel": max(p.numel() for p in params),  # 0 when every param is partitioned
        "tied": model.lm_head.weight is model.transformer.wte.weight,
        "wte_std": gathered["transformer.wte.weight"].std().item(),
        "c_proj_std": gathered["transformer.h.0.mlp.c_proj.weight"].std().item(),  # HF: 0.02 / sqrt(2 * n_layer)
        "checksum": sum(t.double().abs().sum().item() for t in gathered.values()),
    }, gathered


def engine_loss(model: torch.nn.Module, spec, world: int) -> float:
    """Loss of the ZeRO-3 engine on a fixed batch (no step)."""
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(world))
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    engine.eval()
    with torch.no_grad():
        return spec.loss(engine(ids), ids).item()


def main() -> None:
    out_dir, pretrained_dir = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    spec = build("gpt2", "tiny", vocab_size=VOCAB)
    if rank == 0:
        torch.manual_seed(0)
        spec.build().save_pretrained(pretrained_dir)
    dist.barrier()
    pretrained_spec = build("gpt2", "custom", pretrained=pretrained_dir)
    # Unpartitioned reference, built first: while a ZeRO-3 model lives, transformers builds
    # every model under zero.Init.
    reference = pretrained_spec.build()
    ref_state = dict(reference.named_parameters())

    fresh, _ = partition_report(build_module(spec, ds_config(world)))
    model = build_module(pretrained_spec, ds_config(world))
    loaded, gathered = partition_report(model)
    loaded["max_abs_diff_vs_saved"] = max((gathered[n] - ref_state[n]).abs().max().item() for n in gathered)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        loaded["reference_loss"] = pretrained_spec.loss(reference(ids), ids).item()
    loaded["engine_loss"] = engine_loss(model, pretrained_spec, world)

    report = {"rank": rank, "world": world, "num_params": spec.num_params, "fresh": fresh, "pretrained": loaded}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
