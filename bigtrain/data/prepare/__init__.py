"""Prepare text once into memory-mapped token shards: `bigtrain prepare`, and the run's own cache.

    corpus = prepare("data/*.jsonl", tokenizer, "prepared/", num_proc=8)   # resumable, bounded memory
    corpus = PreparedCorpus("prepared/")                                  # what training reads

Submodules load lazily: worker processes import only `worker` (numpy + tokenizers).
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"prepare": "core", "text_source": "core", "default_num_proc": "core",
            "PreparedCorpus": "store", "is_prepared": "store", "read_manifest": "store"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'bigtrain.data.prepare' has no attribute {name!r}")
    return getattr(importlib.import_module(f"bigtrain.data.prepare.{_EXPORTS[name]}"), name)
