"""A package's names, imported on first use (PEP 562's module `__getattr__`): a light import of the package (a
verb's parser for `bigtrain --help`, a prepare worker process) pays for torch or DeepSpeed only when a name that
needs them is asked for."""
from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def lazy_names(package: str, where: dict[str, str]) -> Callable[[str], Any]:
    """The `__getattr__` of `package`: NAME comes from the submodule `where[NAME]` when first asked for, and stays."""
    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{where[name]}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
