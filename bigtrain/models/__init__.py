"""bigtrain's model zoo: `build(family, size, **overrides) -> ModelSpec`.

No module in this package imports deepspeed; `bigtrain.parallel` turns the specs' layer
lists into pipeline modules and applies activation checkpointing and ZeRO-3 init.
"""
import importlib
from typing import Any

# Names load on first use, so `bigtrain models --help` (bigtrain.models.cli) starts without torch.
_WHERE = {
    "SequentialPipeline": "pipeline_form", "module_state_from_pipeline": "pipeline_form",
    "pipeline_state_from_module": "pipeline_form",
    "build": "registry", "canonical": "names", "families": "registry", "family": "registry", "modality": "registry",
    "model_overrides": "registry", "DataFacts": "family", "Family": "family",
    "LayerDef": "spec", "ModelSpec": "spec", "call_module": "spec", "output_logits": "spec", "pipeline_inputs": "spec",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'bigtrain.models' has no attribute {name!r}")
    return getattr(importlib.import_module(f"bigtrain.models.{_WHERE[name]}"), name)
