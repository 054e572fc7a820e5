"""Part of models_dist_checks.py (2 ranks): GPT-2 built inside zero.Init.

Rank 0 first saves a tiny GPT-2 (seed 0) to PRETRAINED_DIR with save_pretrained. Each rank then
builds (a) GPT-2 tiny from its config and (b) the saved one via `pretrained=`, both through
`bigtrain.parallel.build_module` under ZeRO-3; `check()` returns what this rank holds
locally, what the gathered weights look like, and two training steps' losses with and
without DeepSpeed activation checkpointing. The test asserts on those numbers.
"""
from __future__ import annotations

import deepspeed
import torch
from deepspeed import comm as dist

from bigtrain.models import build
from bigtrain.parallel import apply_activation_checkpointing, build_module

VOCAB = 512


def ds_config(world: int) -> dict:
    return {"train_batch_size": world, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}


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


def train_losses(spec, world: int, checkpoint: bool) -> list[float]:
    """Two ZeRO-3 training steps, with or without DeepSpeed activation checkpointing."""
    model = build_module(spec, ds_config(world))
    if checkpoint:
        assert apply_activation_checkpointing(spec, model, method="deepspeed") == spec.config.n_layer
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(world))
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2 + dist.get_rank()))
    losses = []
    for _ in range(2):
        loss = spec.loss(engine(ids), ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def check(pretrained_dir: str) -> dict:
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
    loaded["train_losses"] = train_losses(pretrained_spec, world, checkpoint=False)
    loaded["train_losses_checkpointed"] = train_losses(pretrained_spec, world, checkpoint=True)
    return {"world": world, "num_params": spec.num_params, "fresh": fresh, "pretrained": loaded}
