"""Language-model text: tokenize the corpus once, pack it into fixed-length blocks.

Documents are joined with EOS into one token stream, cached as .npy (keyed by the
corpus content and the tokenizer, so another seq_len reuses it), and cut into blocks of
`seq_len` tokens; the tail shorter than a block is dropped. Each block is one sample:
{"input_ids": [T], "labels": [T]} with labels == input_ids (the model shifts).
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Callable

import numpy as np

from bigtrain.data.cache import cached_arrays
from bigtrain.data.dataset import ArrayDataset, DataBundle, labels_from_inputs, split_rows
from bigtrain.data.sources import Source, load_texts, source_fingerprint
from bigtrain.data.tokenizer import eos_id, resolve_tokenizer, tokenizer_fingerprint

ENCODE_CHUNK = 256  # documents per encode_batch call: bounds the Python lists alive at once
CACHE_VERSION = "tokens-v1"  # bump when the stream layout changes


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned type that holds every id (uint16 halves the cache for small vocabularies)."""
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def tokenize_corpus(docs: list[str], tokenizer, eos: int) -> np.ndarray:
    """One stream: doc0 EOS doc1 EOS ... (an EOS after every document, the last included)."""
    dtype = token_dtype(len(tokenizer))
    parts = []
    for start in range(0, len(docs), ENCODE_CHUNK):
        chunk = docs[start:start + ENCODE_CHUNK]
        if tokenizer.is_fast:  # the Rust batch encoder: parallel, and no "longer than max_length" warnings
            ids = [e.ids for e in tokenizer.backend_tokenizer.encode_batch(chunk, add_special_tokens=False)]
        else:
            ids = [tokenizer.encode(d, add_special_tokens=False) for d in chunk]
        parts += [np.asarray(i + [eos], dtype=dtype) for i in ids]
    assert parts, "tokenize_corpus needs at least one document"
    return np.concatenate(parts)


def pack(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """[n_blocks, seq_len] view of the stream; the incomplete tail is dropped."""
    n_blocks = len(stream) // seq_len
    return stream[:n_blocks * seq_len].reshape(n_blocks, seq_len)


def build_text(src: Source, *, seq_len: int, tokenizer: str | None, vocab_size: int, tokenizer_dir: Path,
               cache_dir: Path, val_fraction: float, text_field: str, is_writer: bool,
               barrier: Callable[[], None]) -> DataBundle:
    """Packed LM blocks from a builtin, file or hub source, split into train and val."""
    docs = functools.cache(lambda: load_texts(src, text_field, cache_dir))  # read only if needed, once
    tok = resolve_tokenizer(tokenizer, tokenizer_dir, vocab_size, docs, is_writer, barrier)
    eos = eos_id(tok)
    key_text = f"{CACHE_VERSION}|{source_fingerprint(src)}|{text_field}|{tokenizer_fingerprint(tok)}"
    key = hashlib.sha256(key_text.encode()).hexdigest()[:20]
    stream = cached_arrays(cache_dir / f"tokens-{key}", lambda: {"ids": tokenize_corpus(docs(), tok, eos)},
                           is_writer, barrier)["ids"]
    blocks = pack(stream, seq_len)
    if len(blocks) < 2:
        raise ValueError(f"data.source={src.text!r} has {len(stream)} tokens: fewer than 2 blocks of "
                         f"data.seq_len={seq_len} (one to train, one to validate); use more text or a "
                         "shorter seq_len")
    train_rows, val_rows = split_rows(len(blocks), val_fraction)
    full = ArrayDataset({"input_ids": blocks}, transform=labels_from_inputs)
    desc = (f"text {src.text!r}: {len(stream):,} tokens, vocab {len(tok)}, {len(train_rows)} train / "
            f"{len(val_rows)} val blocks of {seq_len}")
    return DataBundle(full.subset(train_rows), full.subset(val_rows), tok, len(tok), 0, desc)
