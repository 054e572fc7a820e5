"""Rows of records with images as a vision-language model trains on them: the rows of their layout (examples,
preference pairs, prompts: `bigtrain.data.examples`, `pairs`, `prompt_rows`), built as for text, each batch given
its images.

A batch gets, beside its tokens (the placeholders already expanded at prepare):
    "pixels"          the processor's image tensors for its rows (`bigtrain.models.pixels.PixelInputs`: with the
                      image-token marks a family takes, Gemma 3's token_type_ids), made from
                      the images kept at prepare (`bigtrain.data.vision_store`) by the processor's image part, as the
                      processor's own call makes them: for a pair, the chosen rows' then the rejected rows' (the order
                      `pairs.flat_pairs` puts their tokens in)
    "attention_mask"  1 on each row's tokens, 0 on its padding (as the processor's batch has it)
and its labels never train an image token (TRL masks them too; with data.train_on_prompt they would be targets).
Prompt rows (online RL) get their images instead: each record's image column holds the images themselves, opened, as
TRL hands a reward function the dataset's decoded images.

Packing is refused (its rows' attention is kept apart by restarting positions, which a family's image-token masks
do not follow), and so is a mixture of sources: a mixture's rows are stacked field by field.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from bigtrain.data.dataset import Batch, DataBundle
from bigtrain.data.examples import ExampleRows
from bigtrain.data.pairs import IGNORE, PairRows
from bigtrain.data.prompt_rows import PromptRows
from bigtrain.data.vision import IMAGE_COLUMNS, decode_image
from bigtrain.models.pixels import image_inputs


class ImageRows:
    """Rows of `rows` (one layout's) with their images; a subclass says which examples a batch's rows are."""

    def __init__(self, rows: Any, processor: Any):
        self.rows, self.processor = rows, processor
        self.image_ids = torch.tensor([i for i in processor.image_token_ids if i is not None], dtype=torch.long)

    def __len__(self) -> int:
        return len(self.rows)

    def examples(self, indices: Sequence[int]) -> tuple[list[tuple[Any, int]], np.ndarray | None]:
        """(each row's (image store, example), in the order of the batch's flattened rows; each row's real length in
        the batch's row shape, or None where the batch masks its padding itself)."""
        raise NotImplementedError

    def take(self, indices: Sequence[int]) -> Batch:
        batch = self.rows.take(indices)
        located, lengths = self.examples(indices)
        images = [[decode_image(data) for data in store.images(example)] for store, example in located]
        batch["pixels"] = image_inputs(self.processor, images)
        if lengths is not None:
            ids = batch["input_ids"]
            batch["attention_mask"] = (torch.arange(ids.shape[-1]) < torch.from_numpy(lengths)[..., None]).long()
            batch["labels"] = batch["labels"].masked_fill(torch.isin(ids, self.image_ids), IGNORE)
        return batch


class ExampleImages(ImageRows):
    """Chat examples (one a row: packing is refused)."""

    def examples(self, indices: Sequence[int]) -> tuple[list[tuple[Any, int]], np.ndarray]:
        rows: ExampleRows = self.rows
        found = [int(rows.row_examples(int(i))[0]) for i in indices]
        return [(rows.corpus.images, e) for e in found], rows.lengths[found]


class PairImages(ImageRows):
    """Preference pairs: both sides have the record's images (kept with each)."""

    def examples(self, indices: Sequence[int]) -> tuple[list[tuple[Any, int]], np.ndarray]:
        rows: PairRows = self.rows
        pairs = rows.pairs[np.asarray(indices, dtype=np.int64)]  # [n, 2]: chosen, rejected
        store = rows.corpus.images
        return [(store, int(e)) for e in pairs.T.reshape(-1)], rows.examples.lengths[pairs]


class PromptImages(ImageRows):
    """Prompts for online RL: their pixels, and their records' image columns holding the images opened."""

    def examples(self, indices: Sequence[int]) -> tuple[list[tuple[Any, int]], None]:
        rows: PromptRows = self.rows
        located = [rows._locate(int(i)) for i in indices]
        return [(part.corpus.images, example) for part, example in located], None

    def take(self, indices: Sequence[int]) -> Batch:
        batch = super().take(indices)
        rows: PromptRows = self.rows
        for record, (part, example) in zip(batch["records"], (rows._locate(int(i)) for i in indices)):
            opened = [decode_image(data) for data in part.corpus.images.images(example)]
            for column in IMAGE_COLUMNS:
                if record.get(column) is not None:
                    record[column] = opened if column == "images" else opened[0]
        return batch


WRAPPERS = ((ExampleRows, ExampleImages), (PairRows, PairImages), (PromptRows, PromptImages))


def with_images(bundle: DataBundle, processor: Any) -> DataBundle:
    """The bundle's rows given their images, the processor kept with it; a layout without images is refused."""
    for name in ("train", "val"):
        rows = getattr(bundle, name)
        wrap = next((w for kind, w in WRAPPERS if isinstance(rows, kind)), None)
        if wrap is None:
            raise ValueError(f"records with images train as chat examples, preference pairs or prompts; this data "
                             f"makes {type(rows).__name__} rows (a mixture of sources, or kto answers), which carry "
                             "no images: give one source of those formats")
        setattr(bundle, name, wrap(rows, processor))
    bundle.processor, bundle.sample_prompt = processor, None  # a held-out prompt's tokens alone lack its images
    return bundle


def check_image_cuts(corpora: list[Any], seq_len: int, limit: int | None, long_examples: str) -> None:
    """ValueError (one line) where data.seq_len (a prompt's `limit`) would cut an example's image tokens: the model
    reads every image token or fails. data.long_examples=drop drops those examples whole instead."""
    if long_examples == "drop":
        return
    for corpus in corpora:
        lengths = np.diff(corpus.document_ends(), prepend=0)
        store = corpus.images
        if limit is not None:  # prompts keep their end: any cut loses their start, where the images are
            cut = (lengths > limit) & (store.image_counts > 0)
            room, longest = f"the {limit} tokens left for a prompt", int(lengths[cut].max(initial=0))
        else:
            cut = store.image_ends > seq_len
            room, longest = f"data.seq_len={seq_len}", int(store.image_ends.max(initial=0))
        if cut.any():
            raise ValueError(f"{int(cut.sum()):,} of {len(lengths):,} examples of {corpus.root} are longer than "
                             f"{room} within their image tokens (the model needs all of an image's tokens): raise "
                             f"data.seq_len to at least {longest + (seq_len - limit if limit is not None else 0)}, or "
                             "set data.long_examples=drop to leave them out")


def image_stats(corpora: list[Any]) -> dict:
    """What a start line says of the images: images and image tokens per example."""
    counts = np.concatenate([c.images.image_counts for c in corpora])
    tokens = np.concatenate([c.images.image_tokens for c in corpora])
    return {"images_per_example": float(counts.mean()) if len(counts) else 0.0,
            "image_tokens_per_example": float(tokens.mean()) if len(tokens) else 0.0}
