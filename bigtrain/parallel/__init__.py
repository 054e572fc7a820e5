"""The only package that turns model specs into DeepSpeed objects: pipeline modules,
activation checkpointing from outside the model, ZeRO-3 construction, topology checks."""
from bigtrain.parallel.checkpointing import apply_activation_checkpointing
from bigtrain.parallel.pipeline import load_pipeline_state, to_pipeline_module
from bigtrain.parallel.topology import check_topology
from bigtrain.parallel.zero_init import build_module

__all__ = ["apply_activation_checkpointing", "build_module", "check_topology", "load_pipeline_state",
           "to_pipeline_module"]
