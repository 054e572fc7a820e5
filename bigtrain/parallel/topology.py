"""Checks of a pipeline x data-parallel layout, before any rank builds anything."""
from __future__ import annotations

from bigtrain.config.rules import divisibility_problem


def check_topology(world_size: int, pipeline_stages: int, num_layers: int) -> int:
    """Return the data-parallel size; ValueError naming the fix for an impossible layout.

    DeepSpeed would otherwise fail later with a RuntimeError inside PipelineModule (world
    not divisible) or build empty stages (more stages than layers).
    """
    problem = divisibility_problem(world_size, pipeline_stages)
    if problem:
        raise ValueError(problem)
    if pipeline_stages > num_layers:
        raise ValueError(f"pipeline.stages={pipeline_stages} exceeds the model's {num_layers} pipeline layers: "
                         f"use at most {num_layers} stages or a deeper model")
    return world_size // pipeline_stages
