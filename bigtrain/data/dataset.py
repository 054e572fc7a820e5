"""In-memory datasets that hand out whole batches, the train/val split, and the bundle.

Every dataset here answers `len(ds)` and `ds.take(indices) -> dict[str, Tensor]`; the
samplers pick the indices. Data lives in (memory-mapped) numpy arrays, so a batch is one
fancy-index per field: no DataLoader workers and no per-sample Python.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import numpy as np
import torch

Batch = dict[str, torch.Tensor]


class IndexedDataset(Protocol):
    def __len__(self) -> int: ...

    def take(self, indices: Sequence[int]) -> Batch: ...


class ConcatRows:
    """Several datasets as one index space (the parts of a mixture: token blocks, example rows): part p holds
    [offsets[p], offsets[p+1]). A batch gathers each part's share of the indices in one `take` per part."""

    def __init__(self, parts: list[IndexedDataset]):
        self.parts = parts
        self.offsets = np.cumsum([0] + [len(p) for p in parts])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def take(self, indices: Sequence[int]) -> Batch:
        indices = np.asarray(indices, dtype=np.int64)
        part_of = np.searchsorted(self.offsets, indices, side="right") - 1
        out: Batch = {}
        for p in np.unique(part_of):
            mine = np.flatnonzero(part_of == p)
            batch = self.parts[p].take((indices[mine] - self.offsets[p]).tolist())
            for key, value in batch.items():
                out.setdefault(key, value.new_empty((len(indices), *value.shape[1:])))[torch.from_numpy(mine)] = value
        return out


def _to_tensor(array: np.ndarray) -> torch.Tensor:
    if np.issubdtype(array.dtype, np.integer) and array.dtype != np.uint8:
        return torch.from_numpy(array.astype(np.int64))  # embeddings and losses want int64
    return torch.from_numpy(np.ascontiguousarray(array))


class ArrayDataset:
    """Sample i is row `rows[i]` of every array; `transform` finishes a gathered batch."""

    def __init__(self, arrays: dict[str, np.ndarray], rows: np.ndarray | None = None,
                 transform: Callable[[Batch], Batch] | None = None) -> None:
        lengths = {len(a) for a in arrays.values()}
        assert len(lengths) == 1, f"arrays differ in length: { {k: len(a) for k, a in arrays.items()} }"
        self.arrays = arrays
        self.rows = np.arange(lengths.pop()) if rows is None else np.asarray(rows, dtype=np.int64)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.rows)

    def take(self, indices: Sequence[int]) -> Batch:
        rows = self.rows[np.asarray(indices, dtype=np.int64)]
        batch = {name: _to_tensor(array[rows]) for name, array in self.arrays.items()}
        return self.transform(batch) if self.transform else batch

    def subset(self, rows: np.ndarray) -> "ArrayDataset":
        """A view of some of this dataset's samples (no copy of the arrays)."""
        return ArrayDataset(self.arrays, self.rows[rows], self.transform)


def labels_from_inputs(batch: Batch) -> Batch:
    """Causal LM: labels are the inputs; the model shifts them by one."""
    return {"input_ids": batch["input_ids"], "labels": batch["input_ids"].clone()}


def split_rows(n: int, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic train/val split of n samples: val is evenly spaced, at least one sample.

    Evenly spaced picks cover the whole corpus (every class of an image folder sorted by
    class, every part of a packed text) and do not depend on the seed, so runs with
    different seeds are measured on the same validation set.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"data.val_fraction={val_fraction}: must be in (0, 1), e.g. 0.05")
    n_val = max(1, round(n * val_fraction))
    if n - n_val < 1:
        raise ValueError(f"only {n} samples: too few to hold out {n_val} for validation and still train; "
                         "use more data (or a shorter data.seq_len for text)")
    val = ((2 * np.arange(n_val) + 1) * n) // (2 * n_val)  # middle of each of n_val equal stretches
    keep = np.ones(n, dtype=bool)
    keep[val] = False  # a mask, not np.setdiff1d: that hashes every row (4.4 s for 3.4M blocks)
    return np.flatnonzero(keep), val


# The layouts of a bundle's rows, which an objective declares it reads (`bigtrain.objectives.base.Needs.layout`):
# what a bundle of each holds, and the records that make one.
LAYOUTS = {"rows": ("single examples", "text or single examples"),
           "pairs": ("preference pairs (chosen / rejected answers)",
                     'preference records ({"prompt", "chosen", "rejected"}, or instruction/input/chosen/rejected)'),
           "unpaired": ("kto answers (prompt / completion / label)", 'kto records ({"prompt", "completion", "label"})'),
           "prompts": ("prompt records (prompts without answers)",
                       'prompt records ({"prompt": text or messages, ...any other columns}, data.format=prompt)')}


@dataclass
class DataBundle:
    """What `build_data` returns to the runner.

    `vocab_size` is the tokenizer's length (the model's embedding must have at least this
    many rows; 0 for images); `num_classes` is the classifier width (0 for language models).
    `description` is one line for rank 0 to log. `make_sampler(dp_rank, dp_size, seed)` gives the
    training order (a mixture's; None: a ResumableSampler over `train`); `tokenizer_dir` is where
    the tokenizer is saved (for export), when the data brought or trained one. Chat and instruction
    examples (bigtrain.data.examples) also give `stats` (counts, padding; kept in summary.json) and
    `sample_prompt`, a held-out prompt's token ids for the end-of-run sample.
    """

    train: IndexedDataset
    val: IndexedDataset
    tokenizer: Any  # transformers PreTrainedTokenizerBase, or None for images/synthetic data
    vocab_size: int
    num_classes: int
    description: str
    make_sampler: Callable[[int, int, int], Any] | None = None
    tokenizer_dir: Path | None = None
    stats: dict | None = None
    sample_prompt: list[int] | None = None
    layout: str = "rows"  # LAYOUTS: rows, pairs / unpaired KTO answers (two rows a sample), prompts
    template_from_data: bool = False  # the chat template came with a prepared corpus (its tokenizer_dir), not the run
    prompts: str | None = None  # how the examples asked their prompts (`formats.prompt_rendering`): recorded
    processor: Any = None  # records with images: the vision-language model's processor (bigtrain.data.vision_rows)

    def sampler(self, dp_rank: int, dp_size: int, seed: int) -> Any:
        """The resumable training order for one data-parallel rank."""
        if self.make_sampler is not None:
            return self.make_sampler(dp_rank, dp_size, seed)
        from bigtrain.data.sampler import ResumableSampler
        return ResumableSampler(len(self.train), dp_rank, dp_size, seed)
