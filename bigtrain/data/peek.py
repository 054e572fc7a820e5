"""A look at a run's text data before any rank starts (`bigtrain train` runs it in the launching process): what each
source holds, as the ranks will find it, and its first records read and rendered as the ranks will.

Every verdict is the ranks' own code: the parts and formats (`text.source_part`, `text.source_formats`), the records
read as prepare's workers read them (`prepare.pieces.iter_records`: a record without a format's field), rendered as
they render them (`prepare.worker.render_records`, `chat.Renderer`: conversations without a chat template), and for a
source read to its end within PEEK_RECORDS, filtered exactly as the ranks filter the prepared corpus (`build_pairs`,
`build_unpaired`, `build_examples` on the rendered records: pairs whose answers are all the same). A hub source is
left to the ranks (they stream it); so is anything a tokenizer still to be trained would decide.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bigtrain.data.formats import EXAMPLE_FORMATS, FIELDS, PAIR_FORMATS, UNPAIRED_FORMATS, ExampleOptions, layout_of
from bigtrain.data.mixture import parse_mixture
from bigtrain.data.sources import Source, first_keys

PEEK_RECORDS = 256  # of each source: read and rendered (~0.3 s), and a source no longer than this filtered as the ranks do


@dataclass(frozen=True)
class SourcePeek:
    """What a data source holds: its parts (the text given, a prepared folder or a Source, the format), the layout a
    sample has (rows, pairs or unpaired), whether it is plain text, and its first record's keys (None: no records)."""

    parts: list[tuple[str, Any, str]]
    layout: str
    plain: bool
    keys: list[str] | None


def peek_source(source: str, options: ExampleOptions, split: str = "train", revision: str | None = None,
                streaming: bool = False) -> SourcePeek | None:
    """The parts and formats of a text source (a file, folder, glob, prepared folder or mixture of them); ValueError
    (the ranks' line) for one that cannot be read so; None for a hub source."""
    from bigtrain.data.text import source_formats, source_part
    entries = parse_mixture(source) or [(source, 1.0)]
    parts = [source_part(text, split, revision, streaming) for text, _ in entries]
    if any(isinstance(p, Source) and p.kind == "hub" for p in parts):
        return None
    formats = source_formats(parts, options)
    layout = layout_of(formats[0])
    keys = next((first_keys(p) for p in parts if isinstance(p, Source)), None)
    return SourcePeek([(text, part, fmt) for (text, _), part, fmt in zip(entries, parts, formats)], layout,
                      formats[0] == "text", keys)


def check_first_records(peek: SourcePeek, tokenizer: str | None, options: ExampleOptions, *, seq_len: int,
                        val_fraction: float, text_field: str, tokenizer_known: bool = True) -> None:
    """ValueError (the ranks' line) for a first record that does not read or render, or a source, read whole, that
    leaves too little to train. `tokenizer`: the run's (None: one trained on the data by rank 0, not known yet);
    `tokenizer_known` false: the ranks will have one this process cannot (a Hub model's): records are only read."""
    from bigtrain.data.chat import check_template
    from bigtrain.data.prepare.pieces import iter_records
    prepared = [p for _, p, _ in peek.parts if isinstance(p, Path)]
    # the ranks' tokenizer (text._tokenizer): the named one, else a prepared part's, else one trained on the data;
    # loaded only to render records (plain text needs none here)
    name = tokenizer if tokenizer is not None else prepared[0] / "tokenizer" if prepared and tokenizer_known else None
    formats = [fmt for _, _, fmt in peek.parts]
    tok = None
    if name is not None and set(formats) & set(EXAMPLE_FORMATS):
        from bigtrain.data.tokenizer import load_tokenizer  # transformers: only where records are rendered
        tok = load_tokenizer(name, options.chat_template)
    # prepared parts are rendered already (with the template `prepare --chat-template` saved beside them)
    unprepared = [fmt for _, part, fmt in peek.parts if not isinstance(part, Path)]
    if tok is not None:
        check_template(unprepared, tok)
    elif name is None and tokenizer_known and not options.chat_template:  # one trained here has no chat template
        check_template(unprepared, None)
    for text, part, fmt in peek.parts:
        if not isinstance(part, Source) or part.kind != "files" or part.loader == "text":
            continue  # prepared, or plain text (.txt, builtin): nothing to read by record
        field = tuple(FIELDS[fmt]) if fmt in FIELDS else text_field  # records of a format, or the text field
        records = list(itertools.islice(iter_records(part, field), PEEK_RECORDS + 1))
        if fmt in EXAMPLE_FORMATS and tok is not None:
            render(records[:PEEK_RECORDS], tok, fmt, text, part, whole=len(records) <= PEEK_RECORDS, seq_len=seq_len,
                   val_fraction=val_fraction, options=options)


def check_first_images(peek: SourcePeek, processor: Any) -> None:
    """The first records with images rendered through the processor as prepare's workers render them: their
    placeholders against their images, each image opened (a file, a URL, bytes)."""
    from bigtrain.data.prepare.pieces import iter_records
    from bigtrain.data.prepare.worker import render_records, token_dtype
    from bigtrain.data.vision import IMAGE_FIELDS
    from bigtrain.data.vision_prompts import VisionPromptRenderer, VisionRenderer
    for _, part, fmt in peek.parts:
        if not isinstance(part, Source) or part.kind != "files":
            continue
        records = list(itertools.islice(iter_records(part, tuple(FIELDS[fmt]) + IMAGE_FIELDS), PEEK_RECORDS))
        renderer = (VisionPromptRenderer if fmt == "prompt" else VisionRenderer)(processor, fmt)
        render_records(records, renderer, token_dtype(len(processor.tokenizer)), str(part.files[0]), images=[],
                       base=None if part.files[0].suffix == ".json" else part.files[0].parent)


def render(records: list[dict], tok: Any, fmt: str, text: str, src: Source, *, whole: bool, seq_len: int,
           val_fraction: float, options: ExampleOptions) -> None:
    """Render the records as prepare does; when they are the whole source, build its bundle as the ranks do."""
    from bigtrain.data.chat import Renderer
    from bigtrain.data.prepare.worker import render_records, token_dtype
    ids, mask, ends, answers = render_records(records, Renderer(tok, fmt), token_dtype(len(tok)),
                                       str(src.files[0]) if src.files else text)
    if not whole:
        return
    from bigtrain.data.examples import build_examples
    from bigtrain.data.pairs import build_pairs, build_unpaired
    from bigtrain.data.tokenizer import eos_id
    build = build_pairs if fmt in PAIR_FORMATS else build_unpaired if fmt in UNPAIRED_FORMATS else build_examples
    # as text.py builds a prepared corpus's bundle: its filters say when too few pairs or examples are left to train
    build([RenderedCorpus(text, fmt, ids, mask, ends, answers, eos_id(tok))], [text], None, seq_len, options,
          val_fraction, tok)


class RenderedCorpus:
    """Rendered records in memory, read as a prepared corpus is read (`PreparedCorpus`'s methods the bundles use)."""

    def __init__(self, root: str, fmt: str, ids: np.ndarray, mask: np.ndarray, ends: np.ndarray,
                 answers: np.ndarray, eos: int):
        self.root, self.examples, self.eos_id = root, {"format": fmt}, eos
        self._ids, self._mask, self._ends, self._answers = ids, mask, ends, answers

    def document_ends(self) -> np.ndarray:
        return self._ends

    def answer_starts(self) -> np.ndarray:
        return self._answers

    def tokens(self, start: int, stop: int) -> np.ndarray:
        return self._ids[start:stop]

    def mask(self, start: int, stop: int) -> np.ndarray:
        return self._mask[start:stop]
