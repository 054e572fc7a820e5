"""The only package that turns model specs into DeepSpeed objects: pipeline modules, activation checkpointing
from outside the model, ZeRO-3 construction, tensor / sequence / expert splits (the sizes they share are
`bigtrain.config.topology`'s).

Names are imported on first use, so importing this package does not import DeepSpeed."""
from __future__ import annotations

import importlib
from typing import Any

_WHERE = {"apply_activation_checkpointing": "checkpointing", "build_module": "zero_init",
          "load_pipeline_state": "pipeline", "to_pipeline_module": "pipeline"}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'bigtrain.parallel' has no attribute {name!r}")
    return getattr(importlib.import_module(f"bigtrain.parallel.{_WHERE[name]}"), name)
