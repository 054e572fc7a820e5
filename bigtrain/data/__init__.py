"""Data for bigtrain: text (prepared token shards + tokenizer), classification, images, synthetic.

    bundle = build_data("builtin", "text", seq_len=256, tokenizer_dir=out / "tokenizer",
                        cache_dir=out / "data_cache", is_writer=rank == 0, barrier=dist.barrier)
    sampler = bundle.make_sampler(dp_rank, dp_size, seed)
    for batch in batches(bundle.train, sampler, micro_batch): ...   # checkpoint sampler.state_dict()

Text goes through one path: `bigtrain.data.prepare` tokenizes a source into memory-mapped
token shards (offline with `bigtrain prepare`, or into the run's cache on first use).
Names are imported lazily, so a prepare worker process (which imports
`bigtrain.data.prepare.worker`) never pays for torch.
"""
from __future__ import annotations

from bigtrain.lazy import lazy_names

_EXPORTS = {
    "MODALITIES": "build", "build_data": "build",
    "ArrayDataset": "dataset", "Batch": "dataset", "DataBundle": "dataset", "IndexedDataset": "dataset",
    "split_rows": "dataset",
    "batches": "loader", "eval_batch_count": "loader", "iter_eval_batches": "loader",
    "ResumableSampler": "sampler",
    "ensure_tokenizer": "tokenizer", "load_tokenizer": "tokenizer",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_names(__name__, _EXPORTS)
