"""The worker side of prepare: read one piece, tokenize it in batches, write its shard.

Imported by fresh (spawned) worker processes, so it imports only numpy and `tokenizers`
(never torch or transformers, unless the tokenizer has no fast version). A shard is
committed in three steps: the token file and the document index are written under
temporary names and renamed, then a small JSON marker naming the piece is written
atomically; only a shard with its marker counts as finished, so a kill at any moment
leaves either a finished shard or nothing that a resume would take for one.

Chat and instruction examples (the field read is a tuple of columns) are rendered by
`bigtrain.data.chat.Renderer` instead (transformers' tokenizer classes and Jinja, still no torch):
each example is one document, and the shard gets two more files, the trained-token mask and
where each example's answer starts.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np

from bigtrain.atomic import replacing, write_atomic
from bigtrain.data.prepare.pieces import BATCH_BYTES, Piece, read_piece
from bigtrain.data.vision_store import ImageShardWriter

_STATE: dict[str, Any] = {}  # per worker process: encoder, eos, dtype, shared counters


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned type that holds every id (uint16 halves the shards for vocabularies <= 65536)."""
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def shard_paths(shard_dir: Path, index: int) -> dict[str, Path]:
    """A shard's files; `mask` (uint8 per token, 1 = trained) and `answers` (int64 per example: the offset of its
    first trained token after its first token, or its length when it has none) exist for examples only; `records`
    (each record as a JSON line) for prompt records only (bigtrain.data.prompts)."""
    stem = shard_dir / f"{index:05d}"
    return {"tokens": stem.with_suffix(".bin"), "index": stem.with_suffix(".idx.npy"),
            "mask": stem.with_suffix(".mask.bin"), "answers": stem.with_suffix(".ans.npy"),
            "records": stem.with_suffix(".records.jsonl"), "marker": stem.with_suffix(".json")}


def write_json_atomic(path: Path, data: dict) -> None:
    """A marker, plan or manifest: a reader sees all of it or none."""
    write_atomic(path, json.dumps(data, indent=1))


def make_encoder(tokenizer_dir: str):
    """A function texts -> lists of ids, without special tokens: the Rust tokenizer when there is one."""
    path = Path(tokenizer_dir) / "tokenizer.json"
    if path.is_file():
        from tokenizers import Tokenizer
        backend = Tokenizer.from_file(str(path))
        return lambda texts: [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    from transformers import AutoTokenizer  # a slow (Python) tokenizer only
    slow = AutoTokenizer.from_pretrained(tokenizer_dir)
    return lambda texts: [slow.encode(t, add_special_tokens=False) for t in texts]


def setup(tokenizer_dir: str, eos: int, dtype: str, batch_bytes: int = BATCH_BYTES,
          report: Callable[[list[int]], None] | None = None, fmt: str = "text") -> None:
    """Load the encoder for `process_piece` in this process (the main one too, for a small corpus);
    `report` gets [tokens, docs, input bytes] after every batch of about `batch_bytes` of input. `fmt`: text,
    or the example format (bigtrain.data.chat) whose records this process renders."""
    _STATE.update(encode=make_encoder(tokenizer_dir), eos=eos, dtype=np.dtype(dtype), batch_bytes=batch_bytes,
                  report=report, render=None)
    if fmt != "text":
        _STATE["render"] = make_renderer(tokenizer_dir, fmt)


def make_renderer(tokenizer_dir: str | Path, fmt: str) -> Any:
    """The renderer of `fmt`'s records: the tokenizer's, or where the directory holds a processor (a
    vision-language model's) the processor's, which expands each image placeholder and keeps the images."""
    from bigtrain.data.formats import PROMPT_FORMATS
    from bigtrain.data.vision import has_processor
    if has_processor(tokenizer_dir):
        from bigtrain.data.vision import load_processor
        from bigtrain.data.vision_prompts import VisionPromptRenderer, VisionRenderer
        return (VisionPromptRenderer if fmt in PROMPT_FORMATS else VisionRenderer)(
            load_processor(tokenizer_dir, "the prepared corpus's tokenizer"), fmt)
    from bigtrain.data.chat import Renderer
    from bigtrain.data.prompts import PromptRenderer
    return (PromptRenderer if fmt in PROMPT_FORMATS else Renderer)(_chat_tokenizer(str(tokenizer_dir)), fmt)


def _chat_tokenizer(tokenizer_dir: str) -> Any:
    """transformers' tokenizer with its chat template; the fast class directly, as AutoTokenizer imports torch."""
    if (Path(tokenizer_dir) / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def _die_with_parent() -> None:
    """A prepare killed with -9 takes its workers along (Linux); elsewhere they finish their piece and exit."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def process_piece(piece: Piece, text_field: str | list[str] | tuple[str, ...], shard_dir: str) -> dict:
    """Tokenize one piece into shard `piece.index`; returns its marker (counts and the piece's key)."""
    state = _STATE
    paths = shard_paths(Path(shard_dir), piece.index)
    if not isinstance(text_field, str):
        return _process_examples(piece, tuple(text_field), paths)
    ends: list[np.ndarray] = []
    tokens = docs = 0
    # the token file renamed last (the inner block's file first): its size is what a resume checks
    with replacing(paths["tokens"]) as out:
        for texts, last_ends, nbytes in read_piece(piece, text_field, state["batch_bytes"]):
            ids, doc_ends = _encode(texts, last_ends, state["encode"], state["eos"], state["dtype"])
            out.write(ids.tobytes())
            ends.append(tokens + doc_ends)
            tokens += len(ids)
            docs += len(doc_ends)
            if state["report"] is not None:
                state["report"]([len(ids), len(doc_ends), nbytes])
        with replacing(paths["index"]) as f:
            np.save(f, np.concatenate(ends) if ends else np.zeros(0, np.int64))  # end offset of each document
    marker = {"piece": piece.key(), "tokens": tokens, "docs": docs, "bytes": piece.nbytes}
    write_json_atomic(paths["marker"], marker)
    if piece.kind == "spool":
        Path(piece.path).unlink(missing_ok=True)
    return marker


def _process_examples(piece: Piece, fields: tuple[str, ...], paths: dict[str, Path]) -> dict:
    """Render the piece's example records into shard files: tokens, mask, document ends, answer starts."""
    state = _STATE
    assert state["render"] is not None, "setup(fmt=...) renders examples"
    ends: list[np.ndarray] = []
    answers: list[np.ndarray] = []
    tokens = docs = trained = 0
    keep = getattr(state["render"], "keeps_records", False)  # prompt records: kept whole, for the rewards
    vision = getattr(state["render"], "keeps_images", False)  # records with images: kept beside the tokens
    base = None if piece.kind == "spool" else Path(piece.path).parent  # where relative image paths are read from
    plain_before = state["render"].plain_examples  # the renderer lives on from piece to piece in this process
    # renamed in the reverse order of opening: index, answers, records, mask, and the token file last (its size is
    # what a resume checks)
    with replacing(paths["tokens"]) as out, replacing(paths["mask"]) as mask_out, \
            (replacing(paths["records"], "w", encoding="utf-8") if keep else open(os.devnull, "w")) as records_out, \
            (ImageShardWriter(paths["index"].parent, piece.index) if vision else contextlib.nullcontext()) as images:
        for records, _, nbytes in read_piece(piece, fields, state["batch_bytes"]):
            kept: list = []
            ids, mask, doc_ends, first = render_records(records, state["render"], state["dtype"], piece.path,
                                                        images=kept if vision else None, base=base)
            if vision:
                images.add(kept)
            out.write(ids.tobytes())
            mask_out.write(mask.tobytes())
            if keep:  # one line per prompt: a prompt renders to one example, never to none
                assert len(doc_ends) == len(records), (len(doc_ends), len(records))
                records_out.write("".join(map(state["render"].record_line, records)))
            ends.append(tokens + doc_ends)
            answers.append(first)
            tokens, docs, trained = tokens + len(ids), docs + len(doc_ends), trained + int(np.count_nonzero(mask))
            if state["report"] is not None:
                state["report"]([len(ids), len(doc_ends), nbytes])
        first_answers = np.concatenate(answers) if answers else np.zeros(0, np.int64)
        all_ends = np.concatenate(ends) if ends else np.zeros(0, np.int64)
        with replacing(paths["answers"]) as answers_out, replacing(paths["index"]) as index_out:
            np.save(index_out, all_ends)
            np.save(answers_out, first_answers)
    lengths = np.diff(all_ends, prepend=0)
    marker = {"piece": piece.key(), "tokens": tokens, "docs": docs, "bytes": piece.nbytes, "trained": trained,
              "no_answer": int((first_answers >= lengths).sum()),
              "plain": state["render"].plain_examples - plain_before, **(images.counts if vision else {})}
    write_json_atomic(paths["marker"], marker)
    if piece.kind == "spool":
        Path(piece.path).unlink(missing_ok=True)
    return marker


def render_records(records: list[dict], render: Any, dtype: np.dtype, where: str, images: list | None = None,
                   base: Path | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Ids and mask of the records, where each example ends, and where its answer starts (see shard_paths). A
    renderer that keeps images (`bigtrain.data.vision.VisionRenderer`, reading relative paths from `base`) adds each
    example's to `images`."""
    if images is not None:
        render.base = base
    flat: list[int] = []
    mask: list[int] = []
    ends: list[int] = []
    first: list[int] = []
    for record in records:
        try:
            examples = render.examples(record)  # a preference pair: two, kept next to each other
        except ValueError as e:
            shown = json.dumps(record, ensure_ascii=False, default=str)
            line = _line_of(where, record)
            raise ValueError(f"{where}{f' line {line}' if line else ''}: the record "
                             f"{shown[:80]}{'...' if len(shown) > 80 else ''}: {e}") from None
        if not any(ids for ids, _ in examples):
            continue
        if images is not None:
            images.extend(render.last)
        for ids, trained in examples:
            answer = next((i for i in range(1, len(trained)) if trained[i]), len(ids))
            flat.extend(ids)
            mask.extend(trained)
            ends.append(len(flat))
            first.append(answer)
    return (np.asarray(flat, dtype=dtype), np.asarray(mask, dtype=np.uint8), np.asarray(ends, dtype=np.int64),
            np.asarray(first, dtype=np.int64))


def _line_of(path: str, record: dict) -> int | None:
    """The line of a JSON-lines file that holds `record` (read again on this error path alone), else None."""
    if not str(path).endswith(".jsonl") or not Path(path).is_file():
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            try:
                if line.strip() and json.loads(line) == record:
                    return number
            except ValueError:
                continue
    return None


def _encode(texts: list[str], last_ends: bool, encode, eos: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Ids of the texts with an EOS after each finished document, and where those documents end.

    Only a chunk of a large .txt file (last_ends false) continues its document: it gets no EOS,
    and the document ends (is entered in the index) in the chunk that finishes it.
    """
    flat: list[int] = []
    ends: list[int] = []
    for i, ids in enumerate(encode(texts) if texts else []):
        flat.extend(ids)
        if i < len(texts) - 1 or last_ends:
            flat.append(eos)
            ends.append(len(flat))
    return np.asarray(flat, dtype=dtype), np.asarray(ends, dtype=np.int64)


def main() -> None:
    """`python -m bigtrain.data.prepare.worker`: JSON lines in ({"init"}, then {"piece"} ...), JSON lines out
    ({"progress"} per batch, then {"done": marker} or {"error"}) on the original stdout."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed goes to stderr, never into the protocol

    def send(message: dict) -> None:
        try:
            protocol.write(json.dumps(message) + "\n")
        except BrokenPipeError:  # the main process is gone (killed): nothing left to report to
            os._exit(1)

    _die_with_parent()
    for line in sys.stdin:
        message = json.loads(line)
        if "init" in message:
            setup(**message["init"], report=lambda counts: send({"progress": counts}))
            continue
        try:
            marker = process_piece(Piece(**message["piece"]), message["text_field"], message["shard_dir"])
            send({"done": marker})
        except ValueError as e:  # a problem with the user's data: one line for them
            send({"error": str(e), "user": True})
        except Exception:  # noqa: BLE001 -- a bug: the main process shows the whole traceback
            send({"error": traceback.format_exc()})


if __name__ == "__main__":
    main()
