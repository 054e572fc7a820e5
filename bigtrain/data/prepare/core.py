"""`prepare`: a text source -> token shards + document index + manifest, in bounded memory, resumable.

The main process plans pieces (see pieces.py), skips those whose shard is finished, and
hands the rest to a pool of worker processes that each read, tokenize and write one piece
at a time (worker.py); at most a few pieces are in flight, so memory stays flat however
large the corpus. The manifest is written last, atomically: until it exists the output is
not a prepared corpus, and a rerun (after a kill -9, say) keeps every finished shard.
Chat and instruction examples (`fmt`, bigtrain.data.chat) go the same way, rendered by the workers
into tokens plus the mask of the tokens to train on.
"""
from __future__ import annotations

import fcntl
import itertools
import logging
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from bigtrain.data.prepare.pieces import BATCH_BYTES, PIECE_BYTES, Piece, plan, write_spool
from bigtrain.data.prepare.pool import WorkerPool
from bigtrain.data.prepare.progress import Progress
from bigtrain.data.prepare.store import FORMAT, MANIFEST, PLAN_FILE, PreparedCorpus, damaged_shards
from bigtrain.data.prepare.worker import process_piece, setup, shard_paths, token_dtype, write_json_atomic
from bigtrain.data.sources import Source, parse_source, source_fingerprint
from bigtrain.data.vision_store import damaged as vision_damaged

log = logging.getLogger("bigtrain")


def default_num_proc() -> int:
    """Worker processes by default: the cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def text_source(source: str | Source, split: str = "train", revision: str | None = None,
                streaming: bool = False) -> Source:
    """A source string (or Source) that prepare can read, with the hub options applied."""
    if isinstance(source, str) and (Path(source).expanduser() / PLAN_FILE).is_file():
        raise ValueError(f"data.source={source!r} is a `bigtrain prepare` output, not text to prepare; train on it "
                         f"with --data {source}")
    src = parse_source(source, "text") if isinstance(source, str) else source
    if src.kind not in ("builtin", "files", "hub"):
        raise ValueError(f"data.source={src.text!r}: only text sources (files, 'builtin', 'hf:NAME') can be "
                         "prepared into token shards")
    return replace(src, split=split, revision=revision, streaming=streaming) if src.kind == "hub" else src


def identity(src: Source, tokenizer: Any, text_field: str, hash_content: bool, fmt: str = "text",
             processor: Any = None) -> dict:
    """What a prepared directory was made from; the same identity means the same shards. Examples (`fmt` other
    than text) read their format's columns instead of the text field, and a chat corpus depends on the
    template too (the tokenizer's fingerprint covers its vocabulary only). Records with images (a `processor`)
    read the image columns too, and depend on the processor (the image tokens a placeholder becomes)."""
    import hashlib

    from bigtrain.data.formats import FIELDS, TEMPLATED
    from bigtrain.data.tokenizer import tokenizer_fingerprint
    field: Any = "text" if (src.kind == "files" and src.loader == "text") or src.kind == "builtin" else text_field
    ident = {"format": FORMAT, "source": source_fingerprint(src, hash_content), "text_field": field,
             "tokenizer": tokenizer_fingerprint(tokenizer)}
    if fmt != "text":
        ident.update(text_field=list(FIELDS[fmt]), examples=fmt)
    if fmt in TEMPLATED:
        template = getattr(tokenizer, "chat_template", None) or ""
        ident["chat_template"] = hashlib.sha256(str(template).encode()).hexdigest()[:16]
    if processor is not None:
        from bigtrain.data.vision import IMAGE_FIELDS, processor_fingerprint
        fields = ident["text_field"]
        ident.update(text_field=fields + [f for f in IMAGE_FIELDS if f not in fields and "*?" not in fields],
                     processor=processor_fingerprint(processor))
    return ident


def prepare(source: str | Source, tokenizer: Any, out: str | Path, *, text_field: str = "text",
            num_proc: int | None = None, seq_len: int | None = None, hash_content: bool = False,
            piece_bytes: int = PIECE_BYTES, batch_bytes: int = BATCH_BYTES, progress: bool = True,
            fmt: str = "text", processor: Any = None) -> PreparedCorpus:
    """Tokenize `source` into `out` (or reuse / finish what is there); returns the prepared corpus.

    `tokenizer` is a transformers tokenizer; it is saved into out/tokenizer. `num_proc` worker
    processes (default: every core) tokenize in parallel, one thread each; with 1 (or a corpus of
    one piece) this process tokenizes. `seq_len` only makes the manifest say how many training
    blocks the corpus gives. `piece_bytes` (the unit of work and of resume) and `batch_bytes`
    (text per tokenizer call: what bounds memory) rarely need changing. `fmt`: text, or the example format
    (chat, prompt_completion, alpaca) whose records are rendered with the tokenizer (its chat template); with a
    `processor` (a vision-language model's) records with images, rendered through it, the images kept beside the
    tokens and the processor saved as out/tokenizer.
    """
    from bigtrain.data.tokenizer import eos_id

    src = text_source(source) if isinstance(source, str) else source
    out = Path(out).expanduser()
    ident = identity(src, tokenizer, text_field, hash_content, fmt, processor)
    from bigtrain.data.chat import no_template_line
    from bigtrain.data.formats import TEMPLATED
    if fmt in TEMPLATED and not getattr(tokenizer, "chat_template", None):
        raise ValueError(no_template_line(tokenizer))
    num_proc = num_proc or default_num_proc()
    if num_proc < 1:
        raise ValueError(f"--num-proc {num_proc}: must be >= 1")
    out.mkdir(parents=True, exist_ok=True)
    with _locked(out):
        if _finished(out, ident, src):
            return PreparedCorpus(out)
        _start_or_resume(out, ident)
        _save_tokenizer(processor if processor is not None else tokenizer, out / "tokenizer")
        job = _Job(src, ident, out, token_dtype(len(tokenizer)).name, eos_id(tokenizer), num_proc,
                   (piece_bytes, batch_bytes), fmt)
        started = time.perf_counter()
        shards = job.run(progress)
        _write_manifest(out, src, ident, tokenizer, job, shards, seq_len, time.perf_counter() - started,
                        hash_content)
        shutil.rmtree(out / "spool", ignore_errors=True)
    return PreparedCorpus(out)


@contextmanager
def _locked(out: Path) -> Iterator[None]:
    with open(out / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"another `bigtrain prepare` is writing {out}; wait for it, or give another --out") from None
        yield


def _finished(out: Path, ident: dict, src: Source) -> bool:
    """True when out holds this corpus already, every shard intact; ValueError when it holds another one.
    A shard deleted or truncated since is made again (with the manifest) while the intact ones are kept."""
    if not (out / MANIFEST).is_file():
        return False
    manifest = _read_json(out / MANIFEST) or {}
    made_from = manifest.get("identity", {})
    if made_from == ident:
        damaged = damaged_shards(out, manifest)
        if not damaged:
            return True
        log.info("prepare: %s lacks %d of its %d shards (%s); making them again", out, len(damaged),
                 len(manifest["shards"]), next(iter(damaged.values())))
        (out / MANIFEST).unlink()  # until the shards are whole again this is an unfinished prepare
        return False
    changed = [k for k in ident if ident[k] != made_from.get(k)]
    raise ValueError(f"{out} holds a corpus prepared with a different {' and '.join(changed)} than this one "
                     f"({src.text!r}); give a new --out, or delete {out} to prepare it again")


def _start_or_resume(out: Path, ident: dict) -> None:
    """Keep the finished shards of an interrupted prepare of the same corpus; otherwise start clean."""
    shard_dir = out / "shards"
    plan_path = out / PLAN_FILE
    previous = _read_json(plan_path)
    if previous != ident:
        if shard_dir.exists() and any(shard_dir.iterdir()):
            log.info("prepare: %s holds shards of another source or tokenizer; starting over", out)
        shutil.rmtree(shard_dir, ignore_errors=True)
        shutil.rmtree(out / "spool", ignore_errors=True)
        write_json_atomic(plan_path, ident)
    shard_dir.mkdir(exist_ok=True)
    for stale in [*shard_dir.glob(".*.tmp"), *(out / "spool").glob(".*.tmp")]:
        stale.unlink(missing_ok=True)  # half-written files of a killed run


def _read_json(path: Path) -> Any:
    import json
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _save_tokenizer(tokenizer: Any, directory: Path) -> None:
    from bigtrain.data.tokenizer import has_tokenizer
    if has_tokenizer(directory):
        shutil.rmtree(directory)  # the plan check above made sure it is this identity's, or stale
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer.save_pretrained(str(tmp))
    os.replace(tmp, directory)


class _Job:
    """One prepare run: plan, skip finished pieces, tokenize the rest in a pool (or here, when small)."""

    def __init__(self, src: Source, ident: dict, out: Path, dtype: str, eos: int, num_proc: int,
                 sizes: tuple[int, int], fmt: str = "text"):
        self.src, self.ident, self.out, self.fmt = src, ident, out, fmt
        field = ident["text_field"]
        self.field = field if isinstance(field, str) else tuple(field)  # a tuple: example columns
        self.dtype, self.eos, self.num_proc = dtype, eos, num_proc
        self.piece_bytes, self.batch_bytes = sizes
        self.shard_dir = out / "shards"
        self.total_bytes = _total_bytes(src)
        self.resumed = 0

    def run(self, show: bool) -> list[dict]:
        bar = Progress(self.total_bytes, show)
        markers: dict[int, dict] = {}
        pieces = plan(self.src, self.field, self.piece_bytes, self.out / "spool")
        first = list(itertools.islice(pieces, 2))
        inline = len(first) < 2 or self.num_proc == 1  # no worker processes: tokenize in this one
        pieces = itertools.chain(first, pieces)
        try:
            if inline:
                setup(str(self.out / "tokenizer"), self.eos, self.dtype, self.batch_bytes, report=bar.add, fmt=self.fmt)
                for piece, _ in self._todo(pieces, markers, bar):
                    markers[piece.index] = process_piece(piece, self.field, str(self.shard_dir))
                    bar.finished(markers[piece.index])
            else:
                self._pool(pieces, markers, bar)
        finally:
            bar.close()
        return [markers[i] for i in sorted(markers)]

    def _todo(self, pieces: Iterator[tuple[Piece, list[str] | None]], markers: dict[int, dict],
              bar: Progress) -> Iterator[tuple[Piece, list[str] | None]]:
        """The pieces still to do (spooled to disk first); finished ones go straight into `markers`."""
        for piece, docs in pieces:
            marker = self._finished_marker(piece)
            if marker is not None:
                markers[piece.index] = marker
                self.resumed += 1
                bar.finished(marker, resumed=True)
                continue
            if docs is not None:
                write_spool(piece, docs)
            yield piece, docs

    def _finished_marker(self, piece: Piece) -> dict | None:
        paths = shard_paths(self.shard_dir, piece.index)
        marker = _read_json(paths["marker"])
        if not marker or marker.get("piece") != piece.key() or not paths["index"].is_file():
            return None
        size = paths["tokens"].stat().st_size if paths["tokens"].is_file() else -1
        if self.fmt != "text":  # examples: the mask (one byte a token) and the answer starts too
            mask = paths["mask"].stat().st_size if paths["mask"].is_file() else -1
            if mask != marker["tokens"] or not paths["answers"].is_file():
                return None
        if "images" in marker and vision_damaged(self.shard_dir, f"{piece.index:05d}", marker["docs"]):
            return None
        return marker if size == marker["tokens"] * np.dtype(self.dtype).itemsize else None

    def _pool(self, pieces: Iterator[tuple[Piece, list[str] | None]], markers: dict[int, dict],
              bar: Progress) -> None:
        init = {"tokenizer_dir": str(self.out / "tokenizer"), "eos": self.eos, "dtype": self.dtype,
                "batch_bytes": self.batch_bytes, "fmt": self.fmt}
        field, shard_dir = self.field, str(self.shard_dir)

        def done(piece: Piece, marker: dict) -> None:
            markers[piece.index] = marker
            bar.finished(marker)

        pool = WorkerPool(self.num_proc, init)
        try:
            for piece, _ in self._todo(pieces, markers, bar):  # one piece per worker in flight, no more
                while not pool.idle:
                    pool.poll(0.5, bar.add, done)
                    bar.refresh()
                pool.submit(piece, field, shard_dir)
            while pool.busy:
                pool.poll(0.5, bar.add, done)
                bar.refresh()
        finally:
            pool.close()


def _total_bytes(src: Source) -> int | None:
    """Input bytes, when known before reading (files, the builtin text): the progress bar's total."""
    if src.kind == "files":
        return sum(f.stat().st_size for f in src.files)
    if src.kind == "builtin":
        from bigtrain.data.builtin import builtin_documents
        return sum(len(d.encode("utf-8")) for d in builtin_documents())
    return None


def _write_manifest(out: Path, src: Source, ident: dict, tokenizer: Any, job: _Job, shards: list[dict],
                    seq_len: int | None, seconds: float, hash_content: bool) -> None:
    tokens = sum(s["tokens"] for s in shards)
    if tokens == 0:
        raise ValueError(f"data.source={src.text!r} holds no text (every document empty or missing)")
    manifest = {
        "format": FORMAT, "identity": ident,
        "source": {"text": src.text, "kind": src.kind, "files": len(src.files), "bytes": sum(s["bytes"] for s in shards),
                   "text_field": ident["text_field"], "fingerprint": ident["source"],
                   "hash_content": hash_content,  # for the command that repairs a damaged directory
                   "hub": {"split": src.split, "revision": src.revision} if src.kind == "hub" else None},
        "tokenizer": {"name": str(getattr(tokenizer, "name_or_path", "")), "fingerprint": ident["tokenizer"],
                      "vocab_size": len(tokenizer), "eos_id": job.eos},
        "dtype": job.dtype, "num_docs": sum(s["docs"] for s in shards), "num_tokens": tokens,
        "shards": [{"name": f"{i:05d}", "tokens": s["tokens"], "docs": s["docs"], "bytes": s["bytes"]}
                   for i, s in enumerate(shards)],
        "seq_len": seq_len, "blocks": (tokens - 1) // seq_len if seq_len and job.fmt == "text" else None,
        "num_proc": job.num_proc, "seconds": round(seconds, 3), "resumed_shards": job.resumed,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if job.fmt != "text":
        manifest["examples"] = {"format": job.fmt, "trained_tokens": sum(s["trained"] for s in shards),
                                "no_answer": sum(s["no_answer"] for s in shards)}
        if all("plain" in s for s in shards):  # (a shard an older bigtrain wrote did not count them)
            manifest["examples"]["plain_examples"] = sum(s["plain"] for s in shards)
        for entry, shard in zip(manifest["shards"], shards):
            entry["trained"] = shard["trained"]
    if "processor" in ident:  # records with images: theirs are kept beside the tokens (bigtrain.data.vision_store)
        manifest["vision"] = {"images": sum(s["images"] for s in shards),
                              "image_tokens": sum(s["image_tokens"] for s in shards), "processor": ident["processor"]}
    write_json_atomic(out / MANIFEST, manifest)
