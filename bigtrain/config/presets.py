"""Named run configs. Each is a function; variants are `dataclasses.replace` of a base.

The `DS_CONFIG_PRESETS` are what `bigtrain configs` writes to `ds_configs/`, for a stated
reference world size; the runner recomputes the batch triple for the real one.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from bigtrain.config.run_config import (ActivationCheckpointConfig, BatchConfig, OffloadConfig, PipelineConfig, RunConfig,
                             ZeroConfig)

REFERENCE_WORLD_SIZE = 8

# ZeRO-3 settings for runs that are short of memory (the offload presets): gather fewer parameters
# ahead of use, free each after use, smaller reduce buckets and optimizer groups (DeepSpeed sizes an
# fp32 gradient buffer by the largest group). Measured on GPT-2 40 x 1024, ZeRO-3 + CPU offload,
# 2 ranks: summed peak RSS 14.8 -> 13.2 GiB, and no slower (docs/benchmarks.md, Capacity).
MEMORY_LEAN_ZERO3 = {"max_live_parameters": 100_000_000, "max_reuse_distance": 0,
                     "prefetch_bucket_size": 10_000_000, "reduce_bucket_size": 10_000_000,
                     "sub_group_size": 100_000_000}


def _ds_base() -> RunConfig:
    """A GPT-2 small bf16 run with activation checkpointing: the shape the checked-in files are written for."""
    return RunConfig(precision="bf16", batch=BatchConfig(micro_batch=4, grad_accum=1),
                     activation_checkpointing=ActivationCheckpointConfig(enabled=True))


def zero(stage: int, optimizer: str = "none", param: str = "none") -> Callable[[], RunConfig]:
    def preset() -> RunConfig:
        base = _ds_base()
        lean = MEMORY_LEAN_ZERO3 if param != "none" else {}
        return replace(base, zero=replace(base.zero, stage=stage, **lean),
                       offload=OffloadConfig(optimizer=optimizer, param=param))
    return preset


def pipeline() -> RunConfig:
    base = _ds_base()
    return replace(base, zero=ZeroConfig(stage=1), pipeline=PipelineConfig(stages=2),
                   batch=BatchConfig(micro_batch=4, grad_accum=4))


DS_CONFIG_PRESETS: dict[str, tuple[Callable[[], RunConfig], str]] = {
    "zero0": (zero(0), "No sharding: plain data parallel (DDP-like)."),
    "zero1": (zero(1), "Optimizer states sharded across data-parallel ranks."),
    "zero2": (zero(2), "Optimizer states and gradients sharded."),
    "zero2_offload": (zero(2, optimizer="cpu"), "ZeRO-2 with optimizer states and step on the CPU (ZeRO-Offload)."),
    "zero3": (zero(3), "Parameters, gradients and optimizer states sharded."),
    "zero3_offload": (zero(3, optimizer="cpu", param="cpu"), "ZeRO-3 with optimizer and parameters on the CPU."),
    "zero3_nvme": (zero(3, optimizer="nvme", param="nvme"),
                   "ZeRO-Infinity: optimizer and parameters on NVMe at offload.nvme_path (placeholder "
                   "/local_nvme: set it to a real NVMe mount)."),
    "pipeline": (pipeline, "2 pipeline stages with ZeRO-1 (pipelines support ZeRO 0-1), 4 micro-batches."),
}
