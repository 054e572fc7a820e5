"""Documented dataclass fields: `doc(default, text)` keeps the help text beside the default. The run config's sections
(`bigtrain.config`) and the objectives' own settings (`bigtrain.objectives`, which the run config's `objective`
section is assembled from) are written with it."""
from __future__ import annotations

from dataclasses import Field, field
from typing import Any


def doc(default: Any, text: str) -> Any:
    """A dataclass field with a help text; a callable default (dict, list) becomes a factory."""
    if callable(default) and isinstance(default, type):
        return field(default_factory=default, metadata={"doc": text})
    return field(default=default, metadata={"doc": text})


def field_doc(f: Field) -> str:
    return f.metadata.get("doc", "")
