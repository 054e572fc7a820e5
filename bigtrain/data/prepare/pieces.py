"""A source cut into pieces, and the documents of one piece read in small batches.

A piece is the unit of work and of resume: piece i becomes shard i. Pieces are a pure
function of the source (files, sizes, the piece size), so an interrupted prepare that plans
again gets the same pieces and keeps the shards it finished. File pieces are byte ranges
(jsonl / txt, cut at line starts) or row-group ranges (parquet) that a worker reads
itself. Documents that only the main process can produce (the builtin text, a hub dataset,
a JSON array file) are spooled to a jsonl file per piece, which a worker reads like any
other; a spooled piece is identified by its document range.

The field read is a text column (a str: every document is one text) or, for chat and instruction
examples, a tuple of columns (bigtrain.data.formats.FIELDS: "?" marks an optional one): every document
is then the record itself, a dict, which the worker renders.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from bigtrain.atomic import replacing
from bigtrain.data.chat import record_text
from bigtrain.data.formats import ALL_COLUMNS, columns, no_text_field_line, required
from bigtrain.data.sources import Source, first_not_utf8, line_at, not_utf8

Field = str | tuple[str, ...]  # a text column, or the columns of an example record
PIECE_BYTES = 32 << 20  # input bytes per piece: the resume granularity and the unit handed to a worker
BATCH_BYTES = 1 << 20  # text bytes per encode call: what bounds a worker's memory
BPE_TRAIN_BYTES = 256 << 20  # text a tokenizer trained on the corpus sees at most (all of a smaller corpus)
TXT_CUT = re.compile(rb"(?<=\S)\n(?=\S)")  # a newline between two non-spaces: byte-level BPE tokens cannot differ


@dataclass(frozen=True)
class Piece:
    """kind: jsonl | txt | parquet | spool. jsonl/txt: bytes [start, end) of `path`; parquet: row groups
    [start, end); spool: documents [start, end) of a generated stream, written to `path`. `eos`: the
    piece ends its last document (false for all but the last piece of a large .txt file)."""

    index: int
    kind: str
    path: str
    start: int
    end: int
    eos: bool = True
    nbytes: int = 0  # input bytes, for progress and MB/s

    def key(self) -> dict:
        """What must match for a finished shard to count as this piece's."""
        return {k: v for k, v in asdict(self).items() if not (self.kind == "spool" and k == "path")}


def plan(src: Source, text_field: Field, piece_bytes: int, spool_dir: Path) -> Iterator[tuple[Piece, list[str] | None]]:
    """(piece, documents to spool or None) in source order; spooled pieces carry their documents."""
    if src.kind == "builtin":
        from bigtrain.data.builtin import builtin_documents
        yield from _spooled(builtin_documents(), 0, piece_bytes, spool_dir)
        return
    if src.kind == "hub":
        from bigtrain.data.sources import hub_texts
        yield from _spooled(hub_texts(src, text_field), 0, piece_bytes, spool_dir)
        return
    assert src.kind == "files", src.kind
    index = 0
    for path in src.files:
        if src.loader == "parquet":
            pieces = _parquet_pieces(path, piece_bytes, text_field)
        elif src.loader == "text":
            pieces = _byte_pieces(path, piece_bytes, "txt")
        elif _is_json_array(path):
            pieces = _spooled(_json_array_texts(path, text_field), index, piece_bytes, spool_dir)
        else:
            pieces = _byte_pieces(path, piece_bytes, "jsonl")
        for piece, docs in pieces:
            piece = Piece(**{**asdict(piece), "index": index})
            yield piece, docs
            index += 1


def _byte_pieces(path: Path, piece_bytes: int, kind: str) -> Iterator[tuple[Piece, None]]:
    size = path.stat().st_size
    cuts = [0]
    with open(path, "rb") as f:
        while cuts[-1] + piece_bytes < size:
            cut = _next_cut(f, cuts[-1] + piece_bytes, kind)
            if cut >= size:
                break
            cuts.append(cut)
    cuts.append(size)
    for i, (start, end) in enumerate(zip(cuts, cuts[1:])):
        yield Piece(0, kind, str(path), start, end, eos=kind != "txt" or i == len(cuts) - 2, nbytes=end - start), None


def _next_cut(f, offset: int, kind: str) -> int:
    """The first line start at or after `offset` (for txt: after a TXT_CUT newline)."""
    start = max(0, offset - 2)  # the newline may sit just before `offset`; txt also looks one byte further back
    f.seek(start)
    pos, tail = start, b""
    while chunk := f.read(1 << 16):
        data = tail + chunk
        base = pos - len(tail)  # file offset of data[0]
        skip = offset - 1 - base  # the newline must be at offset - 1 or later
        match = data.find(b"\n", max(skip, 0)) if kind == "jsonl" else _txt_cut(data, max(skip, 0))
        if match >= 0:
            return base + match + 1
        pos += len(chunk)
        tail = data[-2:]
    return pos + 1  # no cut before the end of the file


def _txt_cut(data: bytes, skip: int) -> int:
    found = TXT_CUT.search(data, skip)
    return found.start() if found else -1


def _parquet_pieces(path: Path, piece_bytes: int, text_field: Field) -> Iterator[tuple[Piece, None]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:  # pyarrow's message does not name the file
        raise ValueError(f"{path} is not a Parquet file ({e}); remove it from data.source, or give it the "
                         "extension of what it holds (.txt, .jsonl, .json)") from None
    meta = parquet.metadata
    names = meta.schema.names
    if isinstance(text_field, tuple):
        names = parquet.schema_arrow.names  # the top-level columns ("messages"), not the leaves of nested ones
        missing = [c for c in required(text_field) if c not in names]
        if missing:
            raise ValueError(f"{path} has no column {missing[0]!r} (it has {names}): the columns of these records "
                             f"are {columns(text_field)}; set data.format to the format the file holds")
    elif text_field not in names:
        raise ValueError(no_text_field_line(text_field, str(path), names))
    start, size = 0, 0
    for group in range(meta.num_row_groups):
        size += meta.row_group(group).total_byte_size
        if size >= piece_bytes or group == meta.num_row_groups - 1:
            yield Piece(0, "parquet", str(path), start, group + 1, nbytes=size), None
            start, size = group + 1, 0


def _is_json_array(path: Path) -> bool:
    if path.suffix.lower() != ".json":
        return False
    with open(path, "rb") as f:
        return f.read(4096).lstrip()[:1] == b"["


def _json_array_texts(path: Path, text_field: Field) -> Iterator[Any]:
    """A JSON array of records: read whole (its size bounds the memory); prefer JSON lines for big data."""
    try:
        with open(path, encoding="utf-8") as f:
            records = json.load(f)
    except UnicodeDecodeError:  # its position is within a read buffer, not the file
        raise not_utf8(path, first_not_utf8(path) or 0) from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: line {e.lineno} is not valid JSON ({e.msg} at column {e.colno}); a .json file "
                         "must hold one array of records (or one record per line)") from None
    for i, record in enumerate(records):
        text = _field(record, text_field, f"{path} record {i}")
        if text:
            yield text


def _spooled(texts: Iterable[Any], first: int, piece_bytes: int,
             spool_dir: Path) -> Iterator[tuple[Piece, list[Any]]]:
    """Group a document stream into pieces of about piece_bytes; document ranges identify them."""
    docs: list[str] = []
    size = start = 0
    index = first
    for text in texts:
        docs.append(text)
        size += _doc_bytes(text)
        if size >= piece_bytes:
            yield Piece(index, "spool", str(spool_dir / f"{index:05d}.jsonl"), start, start + len(docs),
                        nbytes=size), docs
            index, start, docs, size = index + 1, start + len(docs), [], 0
    if docs:
        yield Piece(index, "spool", str(spool_dir / f"{index:05d}.jsonl"), start, start + len(docs),
                    nbytes=size), docs


def _doc_bytes(doc: Any) -> int:
    """A spooled document's size as its piece counts it (a text's UTF-8 bytes; a record's as JSON)."""
    return len((doc if isinstance(doc, str) else json.dumps(doc, ensure_ascii=False)).encode("utf-8"))


def write_spool(piece: Piece, docs: list[Any]) -> None:
    """The documents of a spooled piece as jsonl (texts as field "text", records as they are), written whole
    before a worker reads it."""
    path = Path(piece.path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc} if isinstance(doc, str) else doc, ensure_ascii=False) + "\n")


def iter_documents(src: Source, text_field: Field, max_bytes: int | None = None) -> Iterator[str]:
    """The source's texts in order, streamed (chunks of large .txt files as separate texts; every string of an
    example record joined), up to max_bytes."""
    seen = 0
    for record in iter_records(src, text_field):
        text = record if isinstance(record, str) else record_text(record)
        yield text
        seen += len(text)
        if max_bytes is not None and seen >= max_bytes:
            return


def iter_records(src: Source, text_field: Field) -> Iterator[Any]:
    """The source's texts, or for example columns (a tuple) its records, in order and streamed, each checked as
    prepare's workers check it (a record without a format's field is one line naming the file and the line)."""
    for piece, docs in plan(src, text_field, PIECE_BYTES, Path("/nonexistent-spool")):
        batches = [(docs, True, 0)] if docs is not None else read_piece(piece, text_field)
        for texts, _, _ in batches:
            yield from texts


# --- reading a piece (in a worker) -----------------------------------------------------------

def read_piece(piece: Piece, text_field: Field,
               batch_bytes: int = BATCH_BYTES) -> Iterator[tuple[list[Any], bool, int]]:
    """Batches of (texts, last_ends_document, input bytes): every text is a whole document except in .txt
    pieces, whose chunks continue one document that ends (gets an EOS) only at the end of its file.
    The input bytes of the batches add up to the piece's `nbytes`."""
    if piece.kind == "parquet":
        yield from _parquet_texts(piece, text_field)
    elif piece.kind == "txt":
        yield from _txt_chunks(piece, batch_bytes)
    elif piece.kind == "spool":
        spooled = "text" if isinstance(text_field, str) else text_field
        for texts, _ in _jsonl_texts(piece, spooled, batch_bytes):
            yield texts, True, sum(_doc_bytes(t) for t in texts)
    else:
        for texts, nbytes in _jsonl_texts(piece, text_field, batch_bytes):
            yield texts, True, nbytes


def _byte_batches(piece: Piece, cut: re.Pattern | None, batch_bytes: int) -> Iterator[tuple[bytes, int]]:
    """The piece's bytes in batches of about batch_bytes, each ending at a cut (a line start), with the
    file offset of its first byte (for errors that name a line)."""
    if piece.kind == "spool":
        start, end = 0, Path(piece.path).stat().st_size
    else:
        start, end = piece.start, piece.end
    with open(piece.path, "rb") as f:
        f.seek(start)
        pos, carry, offset = start, b"", start  # offset: where the next batch (carry first) starts
        while pos < end:
            buf = f.read(min(batch_bytes, end - pos))
            if not buf:
                raise ValueError(f"{piece.path} is shorter than when the prepare began: it changed; prepare again")
            pos += len(buf)
            data = carry + buf
            if pos < end:
                at = data.rfind(b"\n") + 1 if cut is None else _last_cut(data, cut)
                data, carry = data[:at], data[at:]
            if data:
                yield data, offset
                offset += len(data)


def _last_cut(data: bytes, cut: re.Pattern) -> int:
    last = 0
    for found in cut.finditer(data, max(0, len(data) - (1 << 16))):
        last = found.start() + 1
    if last == 0:
        for found in cut.finditer(data):
            last = found.start() + 1
    return last


def _jsonl_texts(piece: Piece, field: Field, batch_bytes: int) -> Iterator[tuple[list[Any], int]]:
    path = piece.path
    for data, offset in _byte_batches(piece, None, batch_bytes):
        texts = []
        for line in data.split(b"\n"):  # a "\r" before the "\n" is JSON whitespace
            start, offset = offset, offset + len(line) + 1
            if not line.strip():
                continue
            try:
                record = json.loads(line.decode("utf-8"))  # decoded here: json.loads would guess UTF-16/32
            except UnicodeDecodeError as e:
                raise not_utf8(path, start + e.start) from None
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {line_at(path, start)} is not JSON ({e.msg} at column {e.colno}); "
                                 "each line of a .jsonl file must be one JSON object") from None
            text = _field(record, field, lambda: f"{path} line {line_at(path, start)}")  # noqa: B023 -- called now
            if text:
                texts.append(text)
        yield texts, len(data)


def _field(record: object, field: Field, where: str | Callable[[], str]) -> Any:
    """The record's text (None: a null value), or for example columns the record itself; `where`, or what it
    returns (a line number costs a read of the file), names the record in the error."""
    if isinstance(field, tuple):
        return _record(record, field, where)
    if isinstance(record, dict) and isinstance(record.get(field), str):
        return record[field]
    if isinstance(record, dict) and field in record and record[field] is None:
        return None
    where = where() if callable(where) else where
    if not isinstance(record, dict) or field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(no_text_field_line(field, f"a record in {where}", keys))
    raise ValueError(f"data.text_field={field!r}: a value in {where} is {type(record[field]).__name__}, not text")


def _record(record: object, fields: tuple[str, ...], where: str | Callable[[], str]) -> dict:
    if isinstance(record, dict) and all(f in record for f in required(fields)):
        return record
    where = where() if callable(where) else where
    if not isinstance(record, dict):
        raise ValueError(f"a record in {where} is {type(record).__name__}, not an object with {columns(fields)}")
    missing = [f for f in required(fields) if f not in record]
    raise ValueError(f"a record in {where} has no {', '.join(repr(f) for f in missing)} (it has {sorted(record)}); "
                     "every record of one source must be in one format: set data.format to the one it holds, or fix "
                     "the record")


def _txt_chunks(piece: Piece, batch_bytes: int) -> Iterator[tuple[list[str], bool, int]]:
    chunks = _byte_batches(piece, TXT_CUT, batch_bytes)
    previous = next(chunks, None)
    for chunk in chunks:
        yield [_universal_newlines(piece.path, *previous)], False, len(previous[0])
        previous = chunk
    if previous is not None:  # an empty file is no document (as before: empty texts are skipped)
        yield [_universal_newlines(piece.path, *previous)], piece.eos, len(previous[0])


def _universal_newlines(path: str, data: bytes, offset: int) -> str:
    """As Python's text mode reads a .txt file (what `datasets`' text loader gave before); `data` starts at
    byte `offset` of `path`, for the error naming the line that is not UTF-8."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise not_utf8(path, offset + e.start) from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _parquet_texts(piece: Piece, text_field: Field) -> Iterator[tuple[list[Any], bool, int]]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(piece.path)
    if isinstance(text_field, tuple):  # example records: the format's columns the file has, rows as dicts
        names = parquet.schema_arrow.names
        wanted = names if ALL_COLUMNS in text_field else [c for c in columns(text_field) if c in names]
        for batch in parquet.iter_batches(batch_size=1024, row_groups=list(range(piece.start, piece.end)),
                                          columns=wanted):
            yield batch.to_pylist(), True, 0
        yield [], True, piece.nbytes
        return
    texts: list[str] = []
    for batch in parquet.iter_batches(batch_size=1024, row_groups=list(range(piece.start, piece.end)),
                                      columns=[text_field]):
        try:
            texts = [t for t in batch.column(0).to_pylist() if t]
        except UnicodeDecodeError:
            raise ValueError(f"data.text_field={text_field!r}: the column in {piece.path} (row groups "
                             f"{piece.start}-{piece.end - 1}) holds bytes that are not UTF-8 text; write it "
                             "again as UTF-8 strings") from None
        if texts and not isinstance(texts[0], str):
            raise ValueError(f"data.text_field={text_field!r}: the column in {piece.path} holds "
                             f"{type(texts[0]).__name__}, not text")
        yield texts, True, 0
    yield [], True, piece.nbytes  # row groups have no byte offsets: the piece's size counts at its end
