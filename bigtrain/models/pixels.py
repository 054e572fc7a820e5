"""The image side of a vision-language model's batch: the tensors its processor makes of the rows' images
(pixel_values, and per family pixel_attention_mask, image_sizes, ...), with how many images each row has.

A family lays these tensors out one of two ways: per image (LLaVA, Gemma 3: pixel_values [images, 3, H, W], the rows'
images one after another) or per row (Idefics3: [rows, most images of a row, 3, H, W], padded). Every row has at least
one image (a batch without any is refused by the data), so a tensor's first dimension says which: the number of rows,
or the total of images; where the two are equal every row has exactly one image and both readings agree. That is
what lets rows be repeated (a prompt's completions), cut (micro-batches) and stacked (a pair's chosen and rejected
rows) without knowing the family, as TRL's GRPO trainer cuts its pixel tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

TOKEN_TYPES = ("token_type_ids", "mm_token_type_ids")  # what a family calls its marks of the image tokens


@dataclass(frozen=True)
class PixelInputs:
    """Image tensors for `len(counts)` rows; `counts[i]` images belong to row i. A family that marks its image
    tokens (Gemma 3's token_type_ids) names the input (`types`) and the token ids it marks (`image_ids`): the marks
    are made from whatever token rows go in (`inputs_for`), a prompt alone or with its completion."""

    tensors: dict[str, torch.Tensor]
    counts: tuple[int, ...]
    types: str | None = None
    image_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        rows, images = len(self.counts), sum(self.counts)
        for name, value in self.tensors.items():
            if value.shape[0] not in (rows, images):
                raise ValueError(f"the processor's {name} has {value.shape[0]} entries for {rows} rows of {images} "
                                 "images: this family lays its image tensors out otherwise (tiles, crops), which "
                                 "bigtrain does not cut into rows")

    def inputs_for(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model's image inputs for these rows of tokens: the tensors, and the image-token marks where the family
        takes them."""
        if self.types is None:
            return dict(self.tensors)
        ids = torch.tensor(self.image_ids, dtype=input_ids.dtype, device=input_ids.device)
        return {**self.tensors, self.types: torch.isin(input_ids, ids).long()}

    def _per_row(self, value: torch.Tensor) -> bool:
        return value.shape[0] == len(self.counts)

    def _image_ranges(self) -> list[tuple[int, int]]:
        ends = torch.tensor(self.counts).cumsum(0).tolist()
        return [(end - count, end) for end, count in zip(ends, self.counts)]

    def rows(self, start: int, stop: int) -> "PixelInputs":
        """Rows [start, stop) alone."""
        ranges = self._image_ranges()
        first, last = (ranges[start][0], ranges[stop - 1][1]) if stop > start else (0, 0)
        return replace(self, tensors={k: v[start:stop] if self._per_row(v) else v[first:last]
                                      for k, v in self.tensors.items()}, counts=self.counts[start:stop])

    def __getitem__(self, rows: slice) -> "PixelInputs":
        """Rows `rows` (a slice without a step), as a tensor of rows is sliced."""
        start, stop, step = rows.indices(len(self.counts))
        assert step == 1, rows
        return self.rows(start, stop)

    def take(self, rows: list[int]) -> "PixelInputs":
        """These rows, in this order (repeats allowed)."""
        ranges = self._image_ranges()
        images = torch.tensor([i for r in rows for i in range(*ranges[r])], dtype=torch.long)
        order = torch.tensor(rows, dtype=torch.long)
        tensors = {k: v.index_select(0, (order if self._per_row(v) else images).to(v.device))
                   for k, v in self.tensors.items()}
        return replace(self, tensors=tensors, counts=tuple(self.counts[r] for r in rows))

    def repeat_rows(self, n: int) -> "PixelInputs":
        """Each row n times in a row (row 0 n times, then row 1, ...), as a prompt's completions are laid out."""
        return self if n == 1 else self.take([r for r in range(len(self.counts)) for _ in range(n)])

    def then(self, other: "PixelInputs") -> "PixelInputs":
        """These rows, then `other`'s (a pair's chosen rows, then its rejected ones)."""
        assert self.tensors.keys() == other.tensors.keys(), (sorted(self.tensors), sorted(other.tensors))
        return replace(self, tensors={k: _stack(v, other.tensors[k]) for k, v in self.tensors.items()},
                       counts=self.counts + other.counts)

    def to(self, device: Any, float_dtype: torch.dtype | None = None) -> "PixelInputs":
        """On `device`, floating tensors (the pixels) in `float_dtype` when given."""
        moved = {k: v.to(device) for k, v in self.tensors.items()}
        if float_dtype is not None:
            moved = {k: v.to(float_dtype) if v.is_floating_point() else v for k, v in moved.items()}
        return replace(self, tensors=moved)

    def state(self) -> dict[str, Any]:
        """Plain values, as a checkpoint keeps them (`from_state` gives them back)."""
        return {"counts": list(self.counts), "types": self.types, "image_ids": list(self.image_ids),
                "tensors": dict(self.tensors)}

    @staticmethod
    def from_state(state: dict[str, Any]) -> "PixelInputs":
        return PixelInputs(dict(state["tensors"]), tuple(state["counts"]), state["types"], tuple(state["image_ids"]))


def _stack(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two batches' tensor along the first dimension; per-row tensors padded to the longer second one (Idefics3's
    images per row)."""
    if a.dim() > 1 and a.shape[1:] != b.shape[1:]:
        width = max(a.shape[1], b.shape[1])
        a, b = (torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, width - t.shape[1])) for t in (a, b))
    return torch.cat([a, b])


def image_inputs(processor: Any, images: list[list[Any]]) -> PixelInputs:
    """The processor's image tensors for rows of PIL images (one list per row): its image processor on the nested
    list, as the processor's own call makes them, keeping what the model takes (`processor.model_input_names`)."""
    out = processor.image_processor(images=images, return_tensors="pt")
    types = next((k for k in TOKEN_TYPES if k in processor.model_input_names), None)
    keep = set(processor.model_input_names) - {"input_ids", "attention_mask", *TOKEN_TYPES}
    return PixelInputs({k: v for k, v in out.items() if k in keep and isinstance(v, torch.Tensor)},
                       tuple(len(row) for row in images), types,
                       tuple(i for i in processor.image_token_ids if i is not None) if types else ())


def fixed_vision_inputs(directory: str, rows: int = 2, with_image_ids: bool = False) -> Any:
    """The same inputs every time for a vision-language model: `rows` prompts of an image placeholder and a few
    words, each with its own random image, through the processor saved in `directory` (an export's logits check);
    `with_image_ids`: with the ids of the processor's image tokens beside them."""
    import numpy as np
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(directory, local_files_only=True)
    generator = np.random.default_rng(0)
    images = [[Image.fromarray(generator.integers(0, 256, (24 + 8 * r, 32, 3), dtype=np.uint8))] for r in range(rows)]
    text = [f"{processor.image_token} describe the image" for _ in range(rows)]
    batch = processor(text=text, images=images, return_tensors="pt", padding=True)
    inputs = {k: v for k, v in batch.items() if k in processor.model_input_names and isinstance(v, torch.Tensor)}
    return (inputs, [i for i in processor.image_token_ids if i is not None]) if with_image_ids else inputs
