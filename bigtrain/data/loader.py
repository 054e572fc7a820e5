"""Batches for the training loop and for evaluation.

No DataLoader: datasets are in memory and gather a whole batch in one call, and a plain
generator keeps the sampler's position exact (nothing is prefetched past the batch the
trainer has taken, so a checkpoint's sampler state is the next batch to train on).
"""
from __future__ import annotations

import itertools
import math
from typing import Iterator

import numpy as np
import torch

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


def by_length(stream: Iterator[Batch], count: int, ignore: int = -100) -> Iterator[Batch]:
    """Each run of `count` batches (one optimizer step's) with its rows regrouped by length: the step's rows (pairs:
    [pairs, 2, L], each pair as one) sorted by their last trained column (`labels` != `ignore`), stably, and cut
    again into `count` batches of as many rows, so that `trim_padding` cuts a batch of short rows short instead of
    every batch running to the step's longest. The step trains on the same rows; an objective asks for it only
    where its step's loss is the same however they are split (`Objective.step_batches`). Batches whose values are
    not all tensors of rows (images) pass as they are."""
    while True:
        step = list(itertools.islice(stream, count))
        if len(step) < count or not _tensors_of_rows(step):
            yield from step
            if len(step) < count:  # the stream ended
                return
            continue
        joined = {key: torch.cat([b[key] for b in step]) for key in step[0]}
        labels = joined["labels"]
        columns = torch.arange(1, labels.shape[-1] + 1, device=labels.device)
        last = ((labels != ignore) * columns).reshape(labels.shape[0], -1).amax(-1)
        order = torch.argsort(last, stable=True)
        size = step[0]["labels"].shape[0]
        for start in range(0, order.numel(), size):
            yield {key: value[order[start:start + size]] for key, value in joined.items()}


def _tensors_of_rows(step: list[Batch]) -> bool:
    """Whether every batch holds the same keys, each a tensor of the same shape with `labels`' rows."""
    first = step[0]
    rows = first.get("labels")
    return isinstance(rows, torch.Tensor) and all(
        b.keys() == first.keys() and all(isinstance(v, torch.Tensor) and v.shape == first[k].shape
                                         and v.shape[0] == rows.shape[0] for k, v in b.items()) for b in step)


def trim_padding(batch: Batch, ignore: int = -100) -> Batch:
    """`batch` with its rows cut after the last column any of them trains on (`labels` != `ignore`; data.padding=
    longest): what TRL's collators do by padding to the batch's longest row. A causal model's loss at a column reads
    only the columns before it, so the columns cut change no loss, log-probability or gradient; only the tensors
    shaped like `labels` are cut ([rows, L], or [pairs, 2, L]). A batch without labels is returned as it is."""
    labels, ids = batch.get("labels"), batch.get("input_ids")
    if not isinstance(labels, torch.Tensor) or labels.dim() < 2 or getattr(ids, "shape", None) != labels.shape:
        return batch  # not rows of examples (a text block's labels are one longer than its inputs)
    trained = (labels != ignore).reshape(-1, labels.shape[-1]).any(dim=0)
    width = int(trained.nonzero().max()) + 1 if bool(trained.any()) else 1
    if width == labels.shape[-1]:
        return batch
    return {key: value[..., :width] if isinstance(value, torch.Tensor) and value.shape == labels.shape else value
            for key, value in batch.items()}


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
