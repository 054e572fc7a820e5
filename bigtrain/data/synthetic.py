"""Synthetic data for benchmarks and tests: deterministic under a seed, no files needed.

- tokens: uniform random ids (a language model cannot beat log(vocab) on them: for speed only);
- classification tokens: random ids where a quarter of the positions come from a band of the
  vocabulary that belongs to the label, so an encoder can learn them;
- images: a fixed random pattern per class plus noise, generated per sample when taken
  (a large synthetic image set would not fit in memory), so a ResNet can learn them.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from bigtrain.data.dataset import ArrayDataset, Batch, labels_from_inputs

SIGNAL_SHARE = 0.25  # share of classification tokens drawn from the label's band
NOISE = 1.0  # image noise std relative to the unit-variance class pattern


def synthetic_tokens(n: int, seq_len: int, vocab_size: int, seed: int) -> ArrayDataset:
    """n samples of `seq_len` uniform random ids in [0, vocab_size); labels == input_ids."""
    rng = np.random.default_rng([seed, 0])
    ids = rng.integers(0, vocab_size, size=(n, seq_len), dtype=np.int32)  # int64 only per batch
    return ArrayDataset({"input_ids": ids}, transform=labels_from_inputs)


def synthetic_classification(n: int, seq_len: int, vocab_size: int, num_classes: int, seed: int) -> ArrayDataset:
    """n token sequences with learnable labels in [0, num_classes)."""
    if vocab_size < 2 * num_classes:
        raise ValueError(f"data.vocab_size={vocab_size} is too small for {num_classes} classes of synthetic "
                         f"tokens; use data.vocab_size >= {2 * num_classes}")
    rng = np.random.default_rng([seed, 1])
    labels = rng.integers(0, num_classes, size=n, dtype=np.int64)
    ids = rng.integers(0, vocab_size, size=(n, seq_len), dtype=np.int64)
    band = vocab_size // num_classes
    signal = rng.random((n, seq_len)) < SIGNAL_SHARE
    in_band = labels[:, None] * band + rng.integers(0, band, size=(n, seq_len))
    ids = np.where(signal, in_band, ids)
    return ArrayDataset({"input_ids": ids, "labels": labels})


class SyntheticImages:
    """n images [3, size, size] float32 with labels; sample i is the same on every call and rank."""

    def __init__(self, n: int, image_size: int, num_classes: int, seed: int) -> None:
        self.n, self.image_size, self.num_classes, self.seed = n, image_size, num_classes, seed
        self.rows = np.arange(n)
        rng = np.random.default_rng([seed, 2])
        self.labels = rng.integers(0, num_classes, size=n, dtype=np.int64)
        self.patterns = rng.standard_normal((num_classes, 3, image_size, image_size), dtype=np.float32)

    def __len__(self) -> int:
        return len(self.rows)

    def _image(self, i: int) -> np.ndarray:
        noise = np.random.default_rng([self.seed, 3, i]).standard_normal(self.patterns.shape[1:], dtype=np.float32)
        return self.patterns[self.labels[i]] + NOISE * noise

    def take(self, indices: Sequence[int]) -> Batch:
        rows = self.rows[np.asarray(indices, dtype=np.int64)]
        pixels = np.stack([self._image(int(i)) for i in rows])
        return {"pixel_values": torch.from_numpy(pixels), "labels": torch.from_numpy(self.labels[rows])}

    def subset(self, rows: np.ndarray) -> "SyntheticImages":
        """A view of some samples (shares the class patterns)."""
        view = object.__new__(SyntheticImages)
        view.__dict__.update(self.__dict__)
        view.rows = self.rows[rows]
        return view
