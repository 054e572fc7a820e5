"""Checks of a pipeline x data-parallel layout, before any rank builds anything."""
from __future__ import annotations


def check_topology(world_size: int, pipeline_stages: int, num_layers: int) -> int:
    """Return the data-parallel size; ValueError naming the fix for an impossible layout.

    DeepSpeed would otherwise fail later with a RuntimeError inside PipelineModule (world
    not divisible) or build empty stages (more stages than layers).
    """
    if world_size < 1 or pipeline_stages < 1:
        raise ValueError(f"world size {world_size} and pipeline.stages {pipeline_stages} must both be >= 1")
    if world_size % pipeline_stages:
        raise ValueError(
            f"world size {world_size} is not divisible by pipeline.stages={pipeline_stages}: launch a multiple "
            f"of {pipeline_stages} ranks (e.g. --num_gpus {pipeline_stages * max(1, world_size // pipeline_stages)}) "
            f"or choose pipeline.stages dividing {world_size}")
    if pipeline_stages > num_layers:
        raise ValueError(f"pipeline.stages={pipeline_stages} exceeds the model's {num_layers} pipeline layers: "
                         f"use at most {num_layers} stages or a deeper model")
    return world_size // pipeline_stages
