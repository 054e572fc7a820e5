"""Mixtures: `--data 'a/:0.7,b/:0.3'` draws samples from several sources in the given proportions.

The order is one global sequence fixed by the seed, independent of the data-parallel size.
Positions are grouped in chunks of CHUNK: every chunk holds exactly round(w * CHUNK) samples
of each source (largest remainders), in an order permuted by (seed, chunk). The k-th sample
drawn from source c is sample perm_e[k mod n_c] of that source, where perm_e is source c's
own permutation for its epoch e = k // n_c: a small source repeats (a new order each pass)
while a large one is still in its first. Any position maps to its sample in O(1), so the
state is one number, the global position, and rank r of W takes positions r, r+W, r+2W, ...
exactly like ResumableSampler; a resume at another data-parallel size continues the same
sequence (exact up to the last partial round of W samples).
"""
from __future__ import annotations

import re
from typing import Any, Iterator

import numpy as np

CHUNK = 10_000  # positions per chunk: weights are honoured exactly to 1 / CHUNK within every chunk
_WEIGHTED = re.compile(r"^(?P<source>.+):(?P<weight>[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?)$")


def parse_mixture(source: str) -> list[tuple[str, float]] | None:
    """[(source, weight)] for 'a/:0.7,b/:0.3' (weights normalized to sum 1), None for a single source."""
    parts = [p.strip() for p in source.split(",")] if "," in source or _WEIGHTED.match(source.strip()) else []
    if not parts:
        return None
    matches = [_WEIGHTED.match(p) for p in parts]
    if not all(matches):
        bad = next(p for p, m in zip(parts, matches) if not m)
        raise ValueError(f"data.source={source!r}: {bad!r} has no weight; a mixture is 'SRC:WEIGHT,SRC:WEIGHT', "
                         "e.g. 'web/:0.7,code/:0.3'")
    entries = [(m["source"], float(m["weight"])) for m in matches]
    if any(w <= 0 for _, w in entries):
        raise ValueError(f"data.source={source!r}: mixture weights must be positive")
    total = sum(w for _, w in entries)
    return [(s, w / total) for s, w in entries]


def chunk_counts(weights: list[float], chunk: int = CHUNK) -> np.ndarray:
    """Samples of each source per chunk: largest-remainder rounding of weights * chunk (sums to chunk)."""
    exact = np.asarray(weights, dtype=np.float64) * chunk
    counts = np.floor(exact).astype(np.int64)
    for i in np.argsort(-(exact - counts), kind="stable")[:chunk - counts.sum()]:
        counts[i] += 1
    if (counts == 0).any():
        raise ValueError(f"mixture weights {weights}: each must be at least 1/{chunk}")
    return counts


class MixtureSampler:
    """Yields indices into ConcatRows(parts) for one data-parallel rank, forever."""

    def __init__(self, lengths: list[int], weights: list[float], rank: int, world_size: int, seed: int):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"data-parallel rank {rank} of size {world_size}: need 0 <= rank < size")
        if min(lengths) < 1:
            raise ValueError(f"a mixture source has no training samples (lengths {lengths}); use more data or a "
                             "shorter data.seq_len")
        self.lengths, self.weights = list(lengths), list(weights)
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.counts = chunk_counts(weights)
        self.offsets = np.cumsum([0] + self.lengths)
        self.num_samples = int(self.offsets[-1])
        self.position = 0  # samples this rank has yielded
        self._chunk: tuple[int, np.ndarray, np.ndarray] | None = None
        self._perms: dict[int, tuple[int, np.ndarray]] = {}

    def _chunk_order(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        """(source of each position, how many of that source came before it in the chunk)."""
        if self._chunk is None or self._chunk[0] != j:
            order = np.random.default_rng([self.seed, 1, j]).permutation(np.repeat(np.arange(len(self.counts)),
                                                                                   self.counts))
            before = np.empty_like(order)
            for c in range(len(self.counts)):
                where = np.flatnonzero(order == c)
                before[where] = np.arange(len(where))
            self._chunk = (j, order, before)
        return self._chunk[1], self._chunk[2]

    def sample_at(self, g: int) -> int:
        """The sample at global position g."""
        j, o = divmod(g, CHUNK)
        order, before = self._chunk_order(j)
        c = int(order[o])
        k = j * int(self.counts[c]) + int(before[o])
        epoch, i = divmod(k, self.lengths[c])
        if self._perms.get(c, (None,))[0] != epoch:
            self._perms[c] = (epoch, np.random.default_rng([self.seed, 2, c, epoch]).permutation(self.lengths[c]))
        return int(self.offsets[c] + self._perms[c][1][i])

    def source_of(self, index: int) -> int:
        return int(np.searchsorted(self.offsets, index, side="right") - 1)

    def __iter__(self) -> Iterator[int]:
        while True:  # state re-read before every sample, so load_state_dict works on a live iterator
            g = self.position * self.world_size + self.rank
            self.position += 1
            yield self.sample_at(g)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "mixture", "consumed": self.position * self.world_size, "seed": self.seed,
                "weights": self.weights, "lengths": self.lengths, "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the same global sequence; at another data-parallel size, from the same place in it."""
        if state.get("kind") != "mixture":
            raise ValueError("the checkpoint was trained on a single data source, this run mixes several: resume "
                             "with the checkpoint's data.source")
        if state["lengths"] != self.lengths or not np.allclose(state["weights"], self.weights):
            raise ValueError(f"the checkpoint's mixture had sources of {state['lengths']} samples with weights "
                             f"{state['weights']}, this run's has {self.lengths} with {self.weights}: the data "
                             "changed since the checkpoint; resume with the same data settings")
        self.seed = state["seed"]
        self.position = int(state["consumed"]) // self.world_size
        self._chunk, self._perms = None, {}
