"""A data-parallel sampler that reshuffles every epoch and resumes at the exact next sample.

Each epoch has one global order (a permutation seeded by (seed, epoch)); rank r of W takes
positions r, r+W, r+2W, ... of it. All ranks advance in lockstep, so the state is the same
on every rank and only rank 0's needs saving. Because the shards interleave one global
order, a run resumed at another data-parallel size continues that order where it stopped
(exact up to the last partial round of W samples).
"""
from __future__ import annotations

import math
from typing import Any, Iterator

import numpy as np


class ResumableSampler:
    """Yields dataset indices for one data-parallel rank, forever, epoch after epoch.

    Pass the data-parallel rank and size (with pipeline parallelism they differ from the
    global ones). `drop_last` trims each epoch to a multiple of world_size; without it the
    epoch is padded by wrapping around. `state_dict()` taken between two samples and given
    to `load_state_dict` makes a new sampler yield exactly what this one would yield next.
    """

    def __init__(self, num_samples: int, rank: int, world_size: int, seed: int, shuffle: bool = True,
                 drop_last: bool = True) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"data-parallel rank {rank} of size {world_size}: need 0 <= rank < size")
        if num_samples < (world_size if drop_last else 1):
            raise ValueError(f"{num_samples} samples cannot give every one of {world_size} data-parallel ranks "
                             "a sample; use more data (or a shorter data.seq_len for text)")
        self.num_samples, self.rank, self.world_size = num_samples, rank, world_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.epoch = 0
        self.position = 0  # samples of this epoch this rank has yielded
        self._order: tuple[int, int, np.ndarray] | None = None  # (epoch, seed, this rank's indices)

    def __len__(self) -> int:
        """Samples per rank per epoch."""
        if self.drop_last:
            return self.num_samples // self.world_size
        return math.ceil(self.num_samples / self.world_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The global order of an epoch, trimmed or wrapped to len(self) * world_size."""
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        else:
            order = np.arange(self.num_samples)
        return np.resize(order, len(self) * self.world_size)  # np.resize repeats from the start to pad

    def _rank_indices(self) -> np.ndarray:
        if self._order is None or self._order[:2] != (self.epoch, self.seed):
            self._order = (self.epoch, self.seed, self.epoch_order(self.epoch)[self.rank::self.world_size])
        return self._order[2]

    def __iter__(self) -> Iterator[int]:
        # State is re-read before every sample, so load_state_dict works even on a live iterator.
        while True:
            indices = self._rank_indices()
            if self.position >= len(indices):
                self.epoch, self.position = self.epoch + 1, 0
                continue
            index = int(indices[self.position])
            self.position += 1
            yield index

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_samples": self.num_samples, "world_size": self.world_size,
                "shuffle": self.shuffle, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; at another data-parallel size, from the same place in the global order."""
        if state.get("kind") == "mixture":
            raise ValueError("the checkpoint was trained on a mixture of data sources, this run reads one: resume "
                             "with the checkpoint's data.source")
        if state["num_samples"] != self.num_samples:
            raise ValueError(f"the checkpoint's data had {state['num_samples']} samples, this run's has "
                             f"{self.num_samples}: the data (or data.seq_len / val_fraction) changed since the "
                             "checkpoint; resume with the same data settings")
        self.seed, self.shuffle, self.drop_last = state["seed"], state["shuffle"], state["drop_last"]
        self.epoch, self.position = state["epoch"], state["position"]
        if state["world_size"] != self.world_size:
            self.position = state["position"] * state["world_size"] // self.world_size
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
