"""Batches for the training loop and for evaluation.

No DataLoader: datasets are in memory and gather a whole batch in one call, and a plain
generator keeps the sampler's position exact (nothing is prefetched past the batch the
trainer has taken, so a checkpoint's sampler state is the next batch to train on).
"""
from __future__ import annotations

import math
from typing import Iterator

import numpy as np

from bigtrain.data.dataset import Batch, IndexedDataset
from bigtrain.data.sampler import ResumableSampler


def batches(dataset: IndexedDataset, sampler: ResumableSampler, micro_batch: int) -> Iterator[Batch]:
    """Endless micro-batches of `micro_batch` samples in the sampler's order (batches may span epochs)."""
    if micro_batch < 1:
        raise ValueError(f"micro batch {micro_batch}: must be >= 1")
    assert sampler.num_samples == len(dataset), (sampler.num_samples, len(dataset))
    indices = iter(sampler)
    while True:
        yield dataset.take([next(indices) for _ in range(micro_batch)])


def eval_batch_count(num_samples: int, micro_batch: int, world_size: int, max_batches: int | None = None) -> int:
    """Batches each rank evaluates: the same on every rank (ZeRO-3 and pipelines need that)."""
    count = math.ceil(num_samples / (micro_batch * world_size))
    return count if max_batches is None else min(count, max_batches)


def iter_eval_batches(val_dataset: IndexedDataset, micro_batch: int, rank: int, world_size: int,
                      max_batches: int | None = None) -> Iterator[Batch]:
    """Full micro-batches of the validation set in a fixed order, sharded over data-parallel ranks.

    Every rank yields the same number of equally shaped batches; to fill the last round the
    order wraps around, so a few samples may count twice when the set is not a multiple of
    micro_batch * world_size.
    """
    if micro_batch < 1:
        raise ValueError(f"micro batch {micro_batch}: must be >= 1")
    assert 0 <= rank < world_size, (rank, world_size)
    assert len(val_dataset) > 0, "empty validation set"
    count = eval_batch_count(len(val_dataset), micro_batch, world_size, max_batches)
    order = np.resize(np.arange(len(val_dataset)), count * micro_batch * world_size)
    mine = order[rank::world_size]
    for b in range(count):
        yield val_dataset.take(mine[b * micro_batch:(b + 1) * micro_batch].tolist())
