"""The data layer's entry point: explicit settings in, a DataBundle out.

The runner maps its config onto these arguments. Every rank calls `build_data` with the
same arguments; the rank given `is_writer=True` trains the tokenizer and writes caches,
and the others wait at `barrier` and then read what it wrote.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from bigtrain.data.dataset import DataBundle, split_rows
from bigtrain.data.sources import parse_source
from bigtrain.data.synthetic import SyntheticImages, synthetic_classification, synthetic_tokens

if TYPE_CHECKING:
    from bigtrain.data.formats import ExampleOptions

MODALITIES = ("text", "classify", "image", "vision")  # gpt2 -> text, encoder -> classify, resnet -> image, vlm -> vision


def _no_barrier() -> None:
    """The single-process barrier."""


def build_data(source: str = "builtin", modality: str = "text", *, seq_len: int = 256,
               tokenizer: str | None = None, vocab_size: int = 4096, tokenizer_dir: Path | str = "runs/tokenizer",
               cache_dir: Path | str = "runs/data_cache", val_fraction: float = 0.05, seed: int = 1234,
               image_size: int = 32, num_classes: int | None = 10, text_field: str = "text", label_field: str = "label",
               synthetic_samples: int = 4096, is_writer: bool = True,
               barrier: Callable[[], None] = _no_barrier, is_local_writer: bool | None = None,
               split: str = "train", revision: str | None = None, streaming: bool = False,
               hash_content: bool = False, num_proc: int | None = None,
               examples: "ExampleOptions | None" = None) -> DataBundle:
    """Load, tokenize / preprocess, cache and split the data for one modality.

    `source`: "builtin" (Python's reference docs; synthetic images for the image modality,
    as no image set ships with Python), "synthetic", a file / directory / glob of
    txt / jsonl / json / parquet, an image folder, or "hf:NAME[:CONFIG]"; for text also a
    `bigtrain prepare` output or a mixture 'a/:0.7,b/:0.3'.
    `tokenizer`: a directory or hub name; None trains a BPE of `vocab_size` into
    `tokenizer_dir` (or reuses the one there). `seed` drives synthetic data only: the
    split is fixed and the training order is the sampler's. `is_local_writer` marks the rank
    that writes a node-local cache (default: the writer). `split`, `revision`, `streaming`
    apply to hub sources; `hash_content` identifies local files by content instead of
    metadata; `num_proc` is the number of tokenizing processes (default: every core). `examples`: the
    settings of chat and instruction records (format, template, prompt loss, long examples, packing).
    """
    if modality not in MODALITIES:
        raise ValueError(f"data modality {modality!r}: must be one of {MODALITIES}")
    for name, value in (("seq_len", seq_len), ("vocab_size", vocab_size), ("image_size", image_size),
                        ("num_classes", num_classes), ("synthetic_samples", synthetic_samples)):
        if value is not None and value < 1:
            raise ValueError(f"data.{name}={value}: must be a positive integer")
    if num_classes is None and (modality != "classify" or source == "synthetic"):
        num_classes = 10  # None: inferred from the labels of classification records
    if modality == "vision" and source in ("synthetic", "builtin"):
        raise ValueError(f"data.source={source!r}: a vision-language model trains on records with images (TRL's "
                         "vision formats, docs/vision.md); give a jsonl or parquet file of them")
    if source == "synthetic" or (source == "builtin" and modality == "image"):
        bundle = _synthetic(modality, seq_len, vocab_size, num_classes, image_size, synthetic_samples,
                            val_fraction, seed)
        if source == "builtin":
            bundle.description += " (no image set ships with Python: 'builtin' images are synthetic)"
        return bundle
    paths = {"tokenizer_dir": Path(tokenizer_dir), "cache_dir": Path(cache_dir)}
    common = {"val_fraction": val_fraction, "is_writer": is_writer, "barrier": barrier}
    if modality in ("text", "vision"):  # the string itself: it may name a prepared directory or a mixture
        from bigtrain.data.text import build_text
        return build_text(source, seq_len=seq_len, tokenizer=tokenizer, vocab_size=vocab_size,
                          text_field=text_field, is_local_writer=is_local_writer, split=split, revision=revision,
                          streaming=streaming, hash_content=hash_content, num_proc=num_proc, examples=examples,
                          vision=modality == "vision", **paths, **common)
    src = replace(parse_source(source, modality), hash_content=hash_content)
    if src.kind == "hub":
        src = replace(src, split=split, revision=revision)
    if modality == "classify":
        from bigtrain.data.classify import build_classify
        return build_classify(src, seq_len=seq_len, tokenizer=tokenizer, vocab_size=vocab_size,
                              num_classes=num_classes, text_field=text_field, label_field=label_field,
                              **paths, **common)
    from bigtrain.data.images import build_images
    return build_images(src, image_size=image_size, num_classes=num_classes, label_field=label_field,
                        cache_dir=paths["cache_dir"], **common)


def _synthetic(modality: str, seq_len: int, vocab_size: int, num_classes: int, image_size: int, n: int,
               val_fraction: float, seed: int) -> DataBundle:
    train_rows, val_rows = split_rows(n, val_fraction)
    if modality == "text":
        data, vocab, classes = synthetic_tokens(n, seq_len, vocab_size, seed), vocab_size, 0
        what = f"{seq_len} random tokens (vocab {vocab_size})"
    elif modality == "classify":
        data = synthetic_classification(n, seq_len, vocab_size, num_classes, seed)
        vocab, classes, what = vocab_size, num_classes, f"{seq_len} tokens, {num_classes} classes"
    else:
        data, vocab, classes = SyntheticImages(n, image_size, num_classes, seed), 0, num_classes
        what = f"{image_size}x{image_size} images, {num_classes} classes"
    desc = f"synthetic {modality}: {len(train_rows)} train / {len(val_rows)} val samples of {what}"
    return DataBundle(data.subset(train_rows), data.subset(val_rows), None, vocab, classes, desc)
