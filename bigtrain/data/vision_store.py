"""The images of a prepared corpus of records with images, kept beside its tokens: per shard

    OUT/shards/00000.images.bin   every example's images, their bytes as given (PNG, JPEG, ...), one after another
    OUT/shards/00000.images.npy   int64 [images + 1]: where each image starts in the .bin (and where the last ends)
    OUT/shards/00000.vision.npy   int64 [examples, 3]: per example its images, the image tokens they became, and
                                  the offset just past its last image token (what data.seq_len must not cut)

Images are kept as files, not pixel values: a processor's pixel tensor is 10-50 times the compressed image (a
384 x 384 SigLIP input is 1.7 MB in fp32), and their shapes are the family's own; the processor's image part runs
when a batch is taken (`bigtrain.data.vision_rows`), the same on every rank, while the tokens, placeholders expanded
already, are read from the shards like any example's. Written with the shard (`ImageShardWriter`, its files renamed
into place before the shard's marker), read memory-mapped (`ImageStore`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from bigtrain.atomic import replacing

SUFFIXES = {"images": ".images.bin", "offsets": ".images.npy", "vision": ".vision.npy"}


def vision_paths(shard_dir: Path, name: str) -> dict[str, Path]:
    return {key: shard_dir / f"{name}{suffix}" for key, suffix in SUFFIXES.items()}


class ImageShardWriter:
    """Collects a shard's examples' images (`add`), written when the block ends (`bigtrain.atomic.replacing`)."""

    def __init__(self, shard_dir: Path, index: int):
        self.paths = vision_paths(shard_dir, f"{index:05d}")
        self.offsets, self.rows = [0], []

    def __enter__(self) -> "ImageShardWriter":
        self._bin = replacing(self.paths["images"])
        self.out = self._bin.__enter__()
        return self

    def add(self, examples: list[tuple[list[bytes], int, int]]) -> None:
        """Each example's (images' bytes, image tokens, end of its last image token), in the shard's order."""
        for images, tokens, end in examples:
            for data in images:
                self.out.write(data)
                self.offsets.append(self.offsets[-1] + len(data))
            self.rows.append((len(images), tokens, end))

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            for key, array in (("offsets", np.asarray(self.offsets, dtype=np.int64)),
                               ("vision", np.asarray(self.rows, dtype=np.int64).reshape(-1, 3))):
                with replacing(self.paths[key]) as f:
                    np.save(f, array)
        self._bin.__exit__(*exc)

    @property
    def counts(self) -> dict[str, int]:
        rows = np.asarray(self.rows, dtype=np.int64).reshape(-1, 3)
        return {"images": int(rows[:, 0].sum()), "image_tokens": int(rows[:, 1].sum())}


def damaged(shard_dir: Path, name: str, examples: int) -> str | None:
    """What is wrong with a shard's image files (None: whole): missing, or not matching its examples."""
    paths = vision_paths(shard_dir, name)
    missing = [p.name for p in paths.values() if not p.is_file()]
    if missing:
        return f"shards/{missing[0]} is missing"
    rows, offsets = np.load(paths["vision"]), np.load(paths["offsets"])
    if len(rows) != examples or len(offsets) != int(rows[:, 0].sum()) + 1 \
            or paths["images"].stat().st_size != int(offsets[-1]):
        return f"shards/{paths['images'].name} does not hold the images its index lists"
    return None


class ImageStore:
    """A prepared corpus's images by example number (its examples in shard order)."""

    def __init__(self, root: Path, shards: list[dict]):
        shard_dir = root / "shards"
        rows = [np.load(vision_paths(shard_dir, s["name"])["vision"]) for s in shards]
        self.rows = np.concatenate(rows or [np.zeros((0, 3), np.int64)])
        self._offsets = [np.load(vision_paths(shard_dir, s["name"])["offsets"]) for s in shards]
        self._bins = [np.memmap(vision_paths(shard_dir, s["name"])["images"], dtype=np.uint8, mode="r")
                      if offsets[-1] else None for s, offsets in zip(shards, self._offsets)]
        self._shard_first_image = np.cumsum([0] + [int(r[:, 0].sum()) for r in rows])
        self._first_image = np.concatenate([[0], np.cumsum(self.rows[:, 0])]).astype(np.int64)

    @property
    def image_counts(self) -> np.ndarray:
        return self.rows[:, 0]

    @property
    def image_tokens(self) -> np.ndarray:
        return self.rows[:, 1]

    @property
    def image_ends(self) -> np.ndarray:
        """Per example, the offset just past its last image token."""
        return self.rows[:, 2]

    def images(self, example: int) -> list[bytes]:
        """The bytes of the example's images, in the order its placeholders came."""
        first = int(self._first_image[example])
        return [self._image(i) for i in range(first, first + int(self.rows[example, 0]))]

    def _image(self, number: int) -> bytes:
        shard = int(np.searchsorted(self._shard_first_image, number, side="right")) - 1
        local = number - int(self._shard_first_image[shard])
        start, stop = int(self._offsets[shard][local]), int(self._offsets[shard][local + 1])
        return self._bins[shard][start:stop].tobytes()
