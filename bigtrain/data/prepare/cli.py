"""`bigtrain prepare`: tokenize a text source once into memory-mapped token shards for training.

    bigtrain prepare --data 'corpus/*.jsonl' --tokenizer gpt2 --out prepared/corpus --num-proc 8
    bigtrain train --data prepared/corpus ...        # reads the shards; no tokenization at start
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bigtrain.data.prepare.store import PreparedCorpus


def add_prepare_parser(sub: argparse._SubParsersAction) -> None:
    from bigtrain.data.formats import FORMATS  # light: no tokenizer, no torch
    p = sub.add_parser("prepare", help="tokenize text once into token shards that training memory-maps",
                       description="Tokenize a text source (txt/jsonl/json/parquet files, directories, globs, "
                                   "'builtin', hf:NAME[:CONFIG]) into uint16/uint32 token shards, a document "
                                   "index and a manifest. Memory stays flat whatever the corpus size; a rerun "
                                   "after an interruption keeps the finished shards.")
    p.add_argument("--data", required=True, help="the text source (as data.source)")
    p.add_argument("--out", required=True, help="output directory (train with --data OUT)")
    p.add_argument("--tokenizer", help="tokenizer directory or hub name; omitted: train a byte-level BPE of "
                                       "--vocab-size on the corpus (or reuse OUT/tokenizer); a vision-language "
                                       "model's directory renders records with images through its processor")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE size when no --tokenizer (default 4096)")
    p.add_argument("--num-proc", type=int, default=None, help="worker processes (default: every core)")
    p.add_argument("--seq-len", type=int, default=None, help="report how many training blocks this gives")
    p.add_argument("--text-field", default="text", help="text column of jsonl/json/parquet/hub data (default text)")
    p.add_argument("--format", default="auto", choices=FORMATS,
                   help="records: chat ('messages'), sharegpt ('conversations'), prompt_completion, alpaca "
                        "(instruction/input/output), or "
                        "text; auto (default) recognises them from the first record (data.format)")
    p.add_argument("--chat-template", default=None,
                   help="Jinja chat template (a file, or the text) for chat records, when the tokenizer has none "
                        "or another is wanted (data.chat_template)")
    p.add_argument("--split", default="train", help="hub split (data.split, default train)")
    p.add_argument("--revision", default=None, help="hub revision: branch, tag or commit (data.revision)")
    p.add_argument("--streaming", action="store_true", help="stream the hub dataset instead of downloading it first")
    p.add_argument("--hash-content", action="store_true",
                   help="identify local files by their content (reads every byte) instead of name, size, mtime")
    p.add_argument("--piece-mb", type=float, default=None, help=argparse.SUPPRESS)  # tests: small pieces
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_prepare)


def cmd_prepare(args: argparse.Namespace) -> int:
    from bigtrain.data.prepare.core import prepare, text_source
    from bigtrain.data.prepare.store import is_prepared
    from bigtrain.data.prepare.pieces import PIECE_BYTES

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    for name in ("vocab_size", "num_proc", "seq_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} {value}: must be a positive integer")
    if args.num_proc == 1:  # one process means one core: no tokenizer threads either
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from bigtrain.data.chat import read_chat_template
    from bigtrain.data.formats import FIELDS
    from bigtrain.data.sources import detect_format
    from bigtrain.writable import unwritable

    out = Path(args.out)
    if problem := unwritable(out, "--out"):
        raise ValueError(problem)
    from bigtrain.data.mixture import parse_mixture
    if parts := parse_mixture(args.data):
        raise ValueError(f"--data {args.data!r} is a mixture; prepare takes one source: prepare each into its own "
                         f"folder (--data {parts[0][0]} --out OUT_1, ...), then train on 'OUT_1:W1,OUT_2:W2'")
    src = text_source(args.data, args.split, args.revision, args.streaming)
    fmt = detect_format(src, args.format)
    if fmt != "text":  # a BPE trained here learns from the records' strings
        args.text_field = tuple(FIELDS[fmt])
    processor = _processor(args, src, fmt)
    tokenizer = processor.tokenizer if processor is not None else _tokenizer(args, src, out)
    if args.chat_template:
        tokenizer.chat_template = read_chat_template(args.chat_template)
    if processor is not None:
        processor.chat_template = tokenizer.chat_template
    piece_bytes = int(args.piece_mb * 1e6) if args.piece_mb else PIECE_BYTES
    existed = is_prepared(out)
    started = time.perf_counter()
    field = "text" if fmt != "text" else args.text_field
    corpus = prepare(src, tokenizer, out, text_field=field, num_proc=args.num_proc, seq_len=args.seq_len,
                     hash_content=args.hash_content, piece_bytes=piece_bytes, progress=not args.quiet, fmt=fmt,
                     processor=processor)
    if existed:
        print(f"already prepared: {corpus.describe()}")
    else:
        print(summary(corpus.manifest, out, time.perf_counter() - started))
    if corpus.examples and args.seq_len:
        print(too_long_line(corpus, args.seq_len))
    return 0


def too_long_line(corpus: PreparedCorpus, seq_len: int) -> str:
    """For `bigtrain prepare --seq-len`: how many examples exceed it (training truncates or drops them)."""
    import numpy as np
    lengths = np.diff(corpus.document_ends(), prepend=0)
    long = int((lengths > seq_len).sum())
    return (f"{long:,} of {len(lengths):,} examples are longer than seq_len {seq_len} (longest {int(lengths.max()):,} "
            "tokens); training truncates them, or drops them with data.long_examples=drop")


def _processor(args: argparse.Namespace, src, fmt: str):
    """A vision-language model's processor (--tokenizer its directory) when the records carry images: they are
    rendered through it and their images kept beside the tokens (bigtrain.data.vision); else None."""
    from bigtrain.data.vision import IMAGE_FIELDS, carries_images, has_processor, load_processor
    if fmt == "text" or not args.tokenizer or not has_processor(args.tokenizer):
        return None
    from bigtrain.data.prepare.pieces import iter_records
    first = next(iter(iter_records(src, tuple(args.text_field) + IMAGE_FIELDS)), None)
    if not carries_images(first):
        return None
    processor = load_processor(args.tokenizer, "--tokenizer")
    if not getattr(processor.tokenizer, "chat_template", None):
        processor.tokenizer.chat_template = processor.chat_template
    return processor


def _tokenizer(args: argparse.Namespace, src, out: Path):
    from bigtrain.data.tokenizer import ensure_tokenizer, load_tokenizer

    if args.tokenizer:
        return load_tokenizer(args.tokenizer)
    from bigtrain.data.prepare.pieces import BPE_TRAIN_BYTES, iter_documents
    directory = ensure_tokenizer(out / "tokenizer", lambda: iter_documents(src, args.text_field, BPE_TRAIN_BYTES),
                                 args.vocab_size)
    return load_tokenizer(directory)


def summary(manifest: dict, out: Path, seconds: float) -> str:
    """One line: what was prepared, how fast, and what a run will find there."""
    mb = manifest["source"]["bytes"] / 1e6
    from bigtrain.data.formats import PAIR_FORMATS
    pairs = (manifest.get("examples") or {}).get("format") in PAIR_FORMATS
    fmt = (manifest.get("examples") or {}).get("format")
    what = (f"preference pairs ({manifest['num_docs']:,} answers)" if pairs else "prompts" if fmt == "prompt" else
            "examples" if fmt else "documents")
    count = manifest["num_docs"] // 2 if pairs else manifest["num_docs"]
    line = (f"prepared {out}: {count:,} {what}, "
            f"{manifest['num_tokens']:,} tokens "
            f"({manifest['dtype']}, vocab {manifest['tokenizer']['vocab_size']}) in {len(manifest['shards'])} shards "
            f"from {mb:,.1f} MB")
    if manifest.get("resumed_shards"):
        line += f"; kept {manifest['resumed_shards']} shards from an interrupted run"
    line += f"; {seconds:.1f} s, {mb / max(seconds, 1e-9):.2f} MB/s with {manifest['num_proc']} processes"
    if vision := manifest.get("vision"):
        line += (f"; {vision['images']:,} images kept beside the tokens, {vision['image_tokens']:,} image tokens "
                 f"({vision['image_tokens'] / max(manifest['num_docs'], 1):.4g} an example)")
    if manifest.get("blocks") is not None:
        line += f"; {manifest['blocks']:,} blocks of seq_len {manifest['seq_len']} (+1 target)"
    if (manifest.get("examples") or {}).get("format") == "prompt":
        line += "; prompt records (every column kept for the rewards)"
    elif manifest.get("examples"):
        ex = manifest["examples"]
        line += (f"; {ex['format']} examples, {ex['trained_tokens']:,} answer tokens "
                 f"({ex['trained_tokens'] / max(manifest['num_tokens'], 1):.0%})")
        if ex["no_answer"]:
            line += f", {ex['no_answer']:,} without an answer (not trained on)"
        if not ex["trained_tokens"]:
            line += ("\nwarning: no example has an answer (an assistant turn, a completion or output): training on "
                     "this stops unless data.train_on_prompt=true")
    return line


def main(argv: list[str] | None = None) -> int:
    """`python -m bigtrain.data.prepare.cli ...`: the verb alone (no DeepSpeed import), same errors as `bigtrain`."""
    parser = argparse.ArgumentParser(prog="bigtrain")
    add_prepare_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["prepare", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except ValueError as err:
        print(f"bigtrain prepare: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
