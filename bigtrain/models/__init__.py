"""bigtrain's model zoo: `build(family, size, **overrides) -> ModelSpec`.

No module in this package imports deepspeed; `bigtrain.parallel` turns the specs' layer
lists into pipeline modules and applies activation checkpointing and ZeRO-3 init.
"""
from bigtrain.models.pipeline_form import (
    SequentialPipeline,
    module_state_from_pipeline,
    pipeline_state_from_module,
)
from bigtrain.models.registry import build, families
from bigtrain.models.spec import LayerDef, ModelSpec

__all__ = [
    "LayerDef", "ModelSpec", "SequentialPipeline", "build", "families",
    "module_state_from_pipeline", "pipeline_state_from_module",
]
