"""What a `data.source` string names, loading its records through HF `datasets`, and which record format
(`bigtrain.data.formats`) its first record is in.

A source is "builtin", "synthetic", "hf:NAME[:CONFIG]" (a hub dataset), or a local
file / directory / glob of .txt, .jsonl, .json or .parquet files; for images, a
directory laid out as an image folder (one subdirectory per class).
"""
from __future__ import annotations

import codecs
import glob
import hashlib
import json
import os
import socket
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlparse

from bigtrain.data.formats import columns, format_of, no_text_field_line, required

LOADERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
HUB_PREFIX = "hf:"


@dataclass(frozen=True)
class Source:
    """A parsed data source. `kind` is builtin | synthetic | files | imagefolder | hub."""

    kind: str
    files: tuple[Path, ...] = ()
    loader: str = ""  # the `datasets` builder for files: text | json | parquet
    root: Path | None = None  # the image folder
    name: str = ""  # hub dataset name
    config: str | None = None  # hub dataset config
    text: str = ""  # the string the user gave, for messages
    split: str = "train"  # hub split (data.split)
    revision: str | None = None  # hub revision: a branch, tag or commit (data.revision)
    streaming: bool = False  # read the hub dataset as a stream instead of downloading it first (data.streaming)
    hash_content: bool = False  # fingerprint local files by content, not metadata (data.hash_content)


def parse_source(source: str, modality: str) -> Source:
    """Turn a `data.source` string into a Source; ValueError if it names nothing usable."""
    if source in ("builtin", "synthetic"):
        return Source(kind=source, text=source)
    if source.startswith(HUB_PREFIX):
        name, _, config = source[len(HUB_PREFIX):].partition(":")
        if not name:
            raise ValueError(f"data.source={source!r}: give a hub dataset name, e.g. 'hf:wikitext:wikitext-2-raw-v1'")
        return Source(kind="hub", name=name, config=config or None, text=source)
    path = Path(source).expanduser()
    if modality == "image":
        if not path.is_dir():
            raise ValueError(f"data.source={source!r}: image data must be an existing directory laid out as "
                             "an image folder (ROOT/CLASS/IMAGE.png), or 'synthetic'")
        return Source(kind="imagefolder", root=path, text=source)
    files = _match_files(source, path)
    loaders = {LOADERS[f.suffix.lower()] for f in files}
    if len(loaders) > 1:
        raise ValueError(f"data.source={source!r} mixes file types ({', '.join(sorted(loaders))}); "
                         "point it at files of one type (txt, jsonl/json or parquet)")
    return Source(kind="files", files=tuple(files), loader=loaders.pop(), text=source)


def _match_files(source: str, path: Path) -> list[Path]:
    if glob.has_magic(source):
        matched = [Path(p) for p in sorted(glob.glob(os.path.expanduser(source), recursive=True))]
        files = [p for p in matched if p.is_file() and p.suffix.lower() in LOADERS]
        if not files:
            raise ValueError(f"data.source={source!r}: the glob matches no .txt/.jsonl/.json/.parquet file")
        return files
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in LOADERS)
        if not files:
            raise ValueError(f"data.source={source!r}: the directory holds no .txt/.jsonl/.json/.parquet file")
        return files
    if not path.exists():
        raise ValueError(f"data.source={source!r}: no such file or directory; give an existing path, a glob, "
                         "'builtin', 'synthetic' or 'hf:NAME'")
    if path.suffix.lower() not in LOADERS:
        raise ValueError(f"data.source={source!r}: unsupported file type {path.suffix!r}; "
                         "use .txt, .jsonl, .json or .parquet")
    return [path]


def line_at(path: Path | str, offset: int) -> int:
    """1-based number of the line of `path` that holds byte `offset`: the newlines before it counted,
    which reads the file up to there (only ever on an error, so pieces need not track lines)."""
    newlines, left = 0, offset
    with open(path, "rb") as f:
        while left > 0 and (chunk := f.read(min(1 << 20, left))):
            newlines += chunk.count(b"\n")
            left -= len(chunk)
    return newlines + 1


def not_utf8(path: Path | str, offset: int) -> ValueError:
    """The one-line error for a text source whose byte at `offset` is not UTF-8."""
    with open(path, "rb") as f:
        f.seek(offset)
        byte = f.read(1)
    return ValueError(f"{path} is not UTF-8 text (byte 0x{byte.hex()} at line {line_at(path, offset)}, offset "
                      f"{offset}): a binary file, or text in another encoding, among the text sources; remove it "
                      "from data.source, or convert it to UTF-8 (iconv -f ENCODING -t UTF-8)")


def first_not_utf8(path: Path | str) -> int | None:
    """Offset of the first byte of `path` that does not decode as UTF-8 (None: all of it does), 1 MB at a time.
    For errors from readers that do not say where in the file they were (a text-mode read, `datasets`)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    pos = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            pending = len(decoder.getstate()[0])  # bytes of a sequence cut by the previous chunk
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:  # e.start counts from the first pending byte
                return pos - pending + e.start
            if not chunk:
                return None
            pos += len(chunk)


def files_fingerprint(paths: list[Path] | tuple[Path, ...], extra: str = "") -> str:
    """Content hash of files (and their names relative to each other): reads every byte."""
    digest = hashlib.sha256(extra.encode())
    for path in paths:
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def files_metadata_fingerprint(paths: list[Path] | tuple[Path, ...], extra: str = "") -> str:
    """Hash of the files' absolute paths, sizes and modification times: a restart on 100 GB reads no byte.

    A file rewritten in place with the same size within the filesystem's mtime resolution
    goes unnoticed; `data.hash_content=true` hashes the content instead.
    """
    digest = hashlib.sha256(("meta|" + extra).encode())
    for path in paths:
        stat = path.stat()
        digest.update(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    return digest.hexdigest()[:16]


def source_fingerprint(src: Source, hash_content: bool | None = None) -> str:
    """Identifies the source: file metadata (or content, on request) locally, name/split/revision on the hub."""
    hash_content = src.hash_content if hash_content is None else hash_content
    fingerprint = files_fingerprint if hash_content else files_metadata_fingerprint
    if src.kind == "files":
        return fingerprint(src.files, src.loader)
    if src.kind == "imagefolder":
        assert src.root is not None
        return fingerprint(sorted(p for p in src.root.rglob("*") if p.is_file()), "imagefolder")
    if src.kind == "hub":  # an unpinned revision may change upstream: pin data.revision, or use a fresh cache dir
        key = f"{src.name}:{src.config}:{src.split}:{src.revision}"
        return hashlib.sha256(key.encode()).hexdigest()[:16]
    assert src.kind == "builtin", src.kind
    from bigtrain.data.builtin import builtin_fingerprint
    return builtin_fingerprint()


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face Hub answers, checked quickly (the hub clients retry for ~20 s)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    if os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy"):
        return True  # only the proxy can tell; let the client try
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def load_records(src: Source, cache_dir: Path) -> Any:
    """The source's rows as a `datasets.Dataset` (or DatasetDict for an image folder with splits)."""
    import datasets

    hf_cache = str(cache_dir / "hf_datasets")
    if src.kind == "files":
        options = {"sample_by": "document"} if src.loader == "text" else {}  # a .txt file is one document
        return datasets.load_dataset(src.loader, data_files=[str(f) for f in src.files], split="train",
                                     cache_dir=hf_cache, **options)
    if src.kind == "imagefolder":
        return datasets.load_dataset("imagefolder", data_dir=str(src.root), cache_dir=hf_cache)
    return load_hub(replace(src, streaming=False))  # whole columns are needed here


def load_hub(src: Source) -> Any:
    """The hub dataset's split (an IterableDataset when src.streaming); one line when the hub is unreachable."""
    import datasets

    assert src.kind == "hub", src.kind
    if not hub_reachable() and not datasets.config.HF_HUB_OFFLINE:
        raise ValueError(f"data.source={src.text!r} needs the Hugging Face Hub, which is unreachable from here; "
                         "use a local path, 'builtin' or 'synthetic', or set HF_HUB_OFFLINE=1 to use a copy "
                         "already in the local HF cache")
    try:
        return datasets.load_dataset(src.name, src.config, split=src.split, revision=src.revision,
                                     streaming=src.streaming)
    except Exception as e:  # the hub raises many types; the user needs the name and the cause
        raise ValueError(f"data.source={src.text!r}: could not load hub dataset {src.name!r} "
                         f"(split {src.split!r}): {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e


def hub_texts(src: Source, text_field: str | tuple[str, ...]) -> Iterator[Any]:
    """The documents of a hub dataset in order, one batch of rows in memory at a time (streamed or not); for
    example columns (a tuple, bigtrain.data.formats.FIELDS) the rows themselves, as dicts."""
    records = load_hub(src)
    names = records.column_names
    if isinstance(text_field, tuple):
        yield from _hub_records(src, records, text_field)
        return
    if names is not None and text_field not in names:
        raise ValueError(no_text_field_line(text_field, "the data", names))
    for rows in records.iter(batch_size=1000):
        if text_field not in rows:
            raise ValueError(no_text_field_line(text_field, "the data", sorted(rows)))
        yield from (t for t in rows[text_field] if t)


def _hub_records(src: Source, records: Any, fields: tuple[str, ...]) -> Iterator[dict]:
    names = records.column_names
    missing = [c for c in required(fields) if names is not None and c not in names]
    if missing:
        raise ValueError(f"data.source={src.text!r} has no column {missing[0]!r} (it has {names}): the columns of "
                         f"these records are {columns(fields)}; set data.format to the format it holds")
    for rows in records.iter(batch_size=1000):
        yield from (dict(zip(rows, values)) for values in zip(*rows.values()))


def column(records: Any, field: str, what: str) -> list:
    """One column of a dataset, with an error naming the columns there are."""
    names = records.column_names
    if field not in names:
        raise ValueError(f"data.{what}={field!r}: the data has no such column; it has {names}. "
                         f"Set data.{what} to one of them")
    return list(records[field])


def load_texts(src: Source, text_field: str, cache_dir: Path) -> list[str]:
    """The documents of a text source, in a fixed order."""
    if src.kind == "builtin":
        from bigtrain.data.builtin import builtin_documents
        return builtin_documents()
    records = load_records(src, cache_dir)
    field = "text" if src.loader == "text" else text_field  # the txt builder always names it "text"
    return [t for t in column(records, field, "text_field") if t]


def detect_format(src: Source, declared: str) -> str:
    """data.format, or (auto) the format of the source's first record: columns of a Parquet file or a hub
    dataset, keys of the first JSON record; .txt and the builtin text are text."""
    if declared != "auto":
        if declared not in ("auto", "text") and (src.kind == "builtin" or src.loader == "text"):
            raise ValueError(f"data.format={declared}: {src.text!r} is plain text, not records; give jsonl / json / "
                             "parquet records (or hf:NAME) with the format's fields, or set data.format=text")
        return declared
    keys = first_keys(src)
    return "text" if keys is None else format_of(keys)


def first_keys(src: Source) -> list[str] | None:
    """The columns of a Parquet file or a hub dataset, the keys of a JSON source's first record (None: plain text,
    or a first record that cannot be read here: the reader names its line later)."""
    if src.kind == "hub":  # every rank looks: as a stream, so that none downloads the dataset for it
        records = load_hub(replace(src, streaming=True))
        names = records.column_names
        return list(names) if names is not None else list(next(iter(records), {}))
    if src.kind != "files" or src.loader == "text":
        return None
    path = src.files[0]
    if src.loader == "parquet":
        import pyarrow.parquet as pq
        try:
            return list(pq.ParquetFile(path).schema_arrow.names)
        except Exception:  # noqa: BLE001 -- not Parquet: the reader names the file with its own line later
            return None
    record = _first_json_record(path)
    return list(record) if isinstance(record, dict) else None


def _first_json_record(path: Path) -> Any:
    """The first record of a jsonl file, or of a .json array, from the first 4 MB (None when unreadable there:
    the reader reports the file's problem with its line)."""
    with open(path, "rb") as f:
        head = f.read(4 << 20).decode("utf-8", errors="replace")
    text = head.lstrip()
    try:
        if text.startswith("["):
            record, _ = json.JSONDecoder().raw_decode(text[1:].lstrip())
            return record
        line = next((ln for ln in text.splitlines() if ln.strip()), "")
        return json.loads(line)
    except ValueError:
        return None
