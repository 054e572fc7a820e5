"""Sequence classification data for the encoder: {"input_ids": [T], "labels": []} per sample.

Texts are truncated or padded (with the tokenizer's pad token) to `seq_len`. Labels are
integers, or strings mapped to integers in sorted order. Sources: the builtin topic task,
jsonl/json/parquet files or a hub dataset with a text and a label column.
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Callable

import numpy as np

from bigtrain.data.builtin import builtin_classification
from bigtrain.data.cache import cached_arrays
from bigtrain.data.dataset import ArrayDataset, DataBundle, split_rows
from bigtrain.data.sources import Source, column, load_records, source_fingerprint
from bigtrain.data.text import token_dtype
from bigtrain.data.tokenizer import resolve_tokenizer, tokenizer_fingerprint

CACHE_VERSION = "classify-v2"  # v2: attention_mask beside input_ids


def encode_labels(values: list, num_classes: int | None, field: str) -> np.ndarray:
    """Integer labels in [0, num_classes); string labels become their index in sorted order.
    num_classes None: as many classes as the labels need (max + 1)."""
    if values and all(isinstance(v, str) for v in values):
        values = _index_all(values, sorted(set(values)))
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        raise ValueError(f"data.label_field={field!r}: labels must be integers or strings")
    labels = np.asarray(values, dtype=np.int64)
    if num_classes is None:
        num_classes = int(labels.max()) + 1 if labels.size else 0
    if labels.min() < 0 or labels.max() >= num_classes:
        raise ValueError(f"labels in column {field!r} span [{labels.min()}, {labels.max()}] but "
                         f"data.num_classes={num_classes}; set data.num_classes to {labels.max() + 1} "
                         "(labels must be 0..num_classes-1)")
    return labels


def _index_all(values: list[str], names: list[str]) -> list[int]:
    lookup = {name: i for i, name in enumerate(names)}
    return [lookup[v] for v in values]


def _records(src: Source, num_classes: int, text_field: str, label_field: str,
             cache_dir: Path) -> tuple[list[str], np.ndarray]:
    if src.kind == "builtin":
        texts, labels, _ = builtin_classification(num_classes or 10)
        return texts, np.asarray(labels, dtype=np.int64)
    if src.kind == "files" and src.loader == "text":
        raise ValueError(f"data.source={src.text!r}: classification needs labels; give jsonl/json/parquet "
                         f"records with a {text_field!r} and a {label_field!r} column")
    try:
        records = load_records(src, cache_dir)
        texts, values = column(records, text_field, "text_field"), column(records, label_field, "label_field")
    except Exception as e:
        if src.kind == "files" and (isinstance(e, UnicodeDecodeError) or not isinstance(e, ValueError)):
            _name_the_bad_record(src, text_field)
        raise
    return texts, encode_labels(values, num_classes, label_field)


def _name_the_bad_record(src: Source, text_field: str) -> None:
    """`datasets` fails on a file that is not UTF-8 or not JSON without naming it (or with a traceback):
    prepare's reader goes through the files again and raises the one line naming the file and the line."""
    from bigtrain.data.prepare.pieces import iter_documents
    for _ in iter_documents(src, text_field):
        pass


def encode_texts(texts: list[str], tokenizer, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """[N, seq_len] ids, truncated and padded on the right, and the attention mask (1 token, 0 padding)."""
    enc = tokenizer(texts, truncation=True, max_length=seq_len, padding="max_length", return_attention_mask=True)
    return (np.asarray(enc["input_ids"], dtype=token_dtype(len(tokenizer))),
            np.asarray(enc["attention_mask"], dtype=np.int8))


def build_classify(src: Source, *, seq_len: int, tokenizer: str | None, vocab_size: int, tokenizer_dir: Path,
                   cache_dir: Path, val_fraction: float, num_classes: int | None, text_field: str, label_field: str,
                   is_writer: bool, barrier: Callable[[], None]) -> DataBundle:
    """Tokenized, fixed-length classification samples, split into train and val."""
    records = functools.cache(lambda: _records(src, num_classes, text_field, label_field, cache_dir))
    tok = resolve_tokenizer(tokenizer, tokenizer_dir, vocab_size, lambda: records()[0], is_writer, barrier)
    key_text = (f"{CACHE_VERSION}|{source_fingerprint(src)}|{text_field}|{label_field}|{num_classes}|"
                f"{seq_len}|{tokenizer_fingerprint(tok)}")
    key = hashlib.sha256(key_text.encode()).hexdigest()[:20]

    def build() -> dict[str, np.ndarray]:
        texts, labels = records()
        ids, mask = encode_texts(texts, tok, seq_len)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    arrays = cached_arrays(cache_dir / f"classify-{key}", build, is_writer, barrier)
    train_rows, val_rows = split_rows(len(arrays["labels"]), val_fraction)
    full = ArrayDataset(arrays)
    num_classes = num_classes or int(np.asarray(arrays["labels"]).max()) + 1  # inferred from the labels
    counts = np.bincount(np.asarray(arrays["labels"]), minlength=num_classes)
    desc = (f"classify {src.text!r}: {len(train_rows)} train / {len(val_rows)} val texts of {seq_len} tokens, "
            f"{num_classes} classes (smallest {counts.min()}, largest {counts.max()} samples), vocab {len(tok)}")
    return DataBundle(full.subset(train_rows), full.subset(val_rows), tok, len(tok), num_classes, desc)
