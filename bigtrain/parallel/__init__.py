"""The only package that turns model specs into DeepSpeed objects: pipeline modules, activation checkpointing
from outside the model, ZeRO-3 construction, tensor / sequence / expert splits, and the topology they share.

Names are imported on first use: `bigtrain.parallel.topology` is pure and the run config reads it, so importing
this package must not import DeepSpeed."""
from __future__ import annotations

import importlib
from typing import Any

_WHERE = {"apply_activation_checkpointing": "checkpointing", "build_module": "zero_init",
          "check_topology": "topology", "load_pipeline_state": "pipeline", "to_pipeline_module": "pipeline",
          "Topology": "topology"}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'bigtrain.parallel' has no attribute {name!r}")
    return getattr(importlib.import_module(f"bigtrain.parallel.{_WHERE[name]}"), name)
