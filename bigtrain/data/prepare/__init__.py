"""Prepare text once into memory-mapped token shards: `bigtrain prepare`, and the run's own cache.

    corpus = prepare("data/*.jsonl", tokenizer, "prepared/", num_proc=8)   # resumable, bounded memory
    corpus = PreparedCorpus("prepared/")                                  # what training reads

Submodules load lazily: worker processes import only `worker` (numpy + tokenizers).
"""
from __future__ import annotations

from bigtrain.lazy import lazy_names

_EXPORTS = {"prepare": "core", "text_source": "core", "default_num_proc": "core",
            "PreparedCorpus": "store", "is_prepared": "store", "read_manifest": "store"}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_names(__name__, _EXPORTS)
