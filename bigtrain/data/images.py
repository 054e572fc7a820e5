"""Image classification data from an image folder: {"pixel_values": [3,H,W] float, "labels": []}.

`datasets` reads the folder (ROOT/CLASS/IMAGE, or ROOT/train|validation|test/CLASS/IMAGE);
each image is resized on its shorter side, center-cropped to a square and kept as uint8 in
a .npy cache; batches are normalized with the ImageNet mean and std when taken. Plain PIL
and numpy: no torchvision.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from PIL import Image

from bigtrain.data.cache import cached_arrays
from bigtrain.data.classify import encode_labels
from bigtrain.data.dataset import ArrayDataset, Batch, DataBundle, split_rows
from bigtrain.data.sources import Source, load_records, source_fingerprint

MEAN = (0.485, 0.456, 0.406)  # ImageNet statistics: the usual choice when a folder's own are unknown
STD = (0.229, 0.224, 0.225)
VAL_SPLITS = ("validation", "valid", "val", "test")
CACHE_VERSION = "images-v1"


def preprocess(image: Image.Image, size: int) -> np.ndarray:
    """RGB uint8 [3, size, size]: shorter side resized to `size`, then the center square."""
    image = image.convert("RGB")
    scale = size / min(image.size)
    width, height = max(size, round(image.width * scale)), max(size, round(image.height * scale))
    image = image.resize((width, height), Image.Resampling.BICUBIC)
    left, top = (width - size) // 2, (height - size) // 2
    image = image.crop((left, top, left + size, top + size))
    return np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)


def normalize(batch: Batch) -> Batch:
    """uint8 pixels -> normalized float32."""
    pixels = batch["pixel_values"].float().div_(255.0)
    mean = torch.tensor(MEAN).view(1, 3, 1, 1)
    std = torch.tensor(STD).view(1, 3, 1, 1)
    return {"pixel_values": (pixels - mean) / std, "labels": batch["labels"]}


def _image_column(records: Any) -> str:
    import datasets

    for name, feature in records.features.items():
        if isinstance(feature, datasets.Image):
            return name
    raise ValueError(f"the image data has no image column (columns: {records.column_names})")


def _encode(records: Any, size: int, num_classes: int, label_field: str) -> dict[str, np.ndarray]:
    from bigtrain.data.sources import column

    images = records[_image_column(records)]
    pixels = np.stack([preprocess(image, size) for image in images])
    labels = encode_labels(column(records, label_field, "label_field"), num_classes, label_field)
    return {"pixel_values": pixels, "labels": labels}


def _splits(records: Any) -> tuple[Any, Any | None]:
    """(train, val) when the folder or hub dataset has its own validation split, else (all, None)."""
    if not hasattr(records, "keys"):
        return records, None
    val = next((records[s] for s in VAL_SPLITS if s in records), None)
    return records["train"], val


def build_images(src: Source, *, image_size: int, num_classes: int, label_field: str, cache_dir: Path,
                 val_fraction: float, is_writer: bool, barrier: Callable[[], None]) -> DataBundle:
    """Preprocessed, cached image samples from a folder or hub dataset, split into train and val."""
    field = "label" if src.kind == "imagefolder" else label_field  # imagefolder names the class column "label"
    key_text = f"{CACHE_VERSION}|{source_fingerprint(src)}|{image_size}|{num_classes}|{field}"
    key = hashlib.sha256(key_text.encode()).hexdigest()[:20]

    def build() -> dict[str, np.ndarray]:
        train, val = _splits(load_records(src, cache_dir))
        arrays = _encode(train, image_size, num_classes, field)
        if val is not None:  # one cache entry: train rows first, then the given val rows
            val_arrays = _encode(val, image_size, num_classes, field)
            arrays = {k: np.concatenate([arrays[k], val_arrays[k]]) for k in arrays}
            arrays["is_val"] = np.arange(len(arrays["labels"])) >= len(train)
        return arrays

    arrays = cached_arrays(cache_dir / f"images-{key}", build, is_writer, barrier)
    is_val = arrays.pop("is_val", None)
    if is_val is None:
        train_rows, val_rows = split_rows(len(arrays["labels"]), val_fraction)
    else:
        train_rows, val_rows = np.flatnonzero(~is_val), np.flatnonzero(is_val)
    full = ArrayDataset(arrays, transform=normalize)
    desc = (f"images {src.text!r}: {len(train_rows)} train / {len(val_rows)} val images of "
            f"{image_size}x{image_size}, {num_classes} classes")
    return DataBundle(full.subset(train_rows), full.subset(val_rows), None, 0, num_classes, desc)
