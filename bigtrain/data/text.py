"""Language-model text: one path from any source to memory-mapped training blocks.

A source that is a `bigtrain prepare` output (a directory with a manifest) is read as it is.
Any other text source (files, 'builtin', hf:NAME) is prepared by the same code into the
run's cache first (`cache_dir/prepared-KEY`, keyed by the source's metadata fingerprint,
the text field and the tokenizer), by the writer rank while the others wait, so a restart
finds it and reads no source byte. A mixture 'a/:0.7,b/:0.3' does this per source. The
token stream is cut into overlapping blocks of seq_len + 1 tokens (see blocks.py). Chat and
instruction records (data.format, recognised from the first record) are prepared the same way into
examples with their answer marked, and served as rows of examples (see examples.py).
"""
from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path
from typing import Any, Callable

from bigtrain.data.blocks import TokenBlocks, block_count
from bigtrain.data.chat import check_template, read_chat_template
from bigtrain.data.dataset import ConcatRows, DataBundle, split_rows
from bigtrain.data.formats import (FIELDS, PAIR_FORMATS, PROMPT_FORMATS, TEMPLATED, UNPAIRED_FORMATS, ExampleOptions,
                                   prompt_rendering)
from bigtrain.data.mixture import MixtureSampler, parse_mixture
from bigtrain.data.prepare.core import identity, prepare, text_source
from bigtrain.data.prepare.pieces import BPE_TRAIN_BYTES, iter_documents
from bigtrain.data.prepare.store import PLAN_FILE, PreparedCorpus, is_complete, is_prepared, read_manifest
from bigtrain.data.prepare.worker import token_dtype  # noqa: F401 -- re-exported for classify
from bigtrain.data.sources import Source, detect_format

Part = Path | Source  # a prepared directory, or a source to prepare
KIND_NAMES = {"text": "plain text", "examples": "chat/instruction examples", "pairs": "preference pairs",
              "unpaired": "kto answers", "prompts": "prompt records"}


def build_text(source: str, *, seq_len: int, tokenizer: str | None, vocab_size: int, tokenizer_dir: Path,
               cache_dir: Path, val_fraction: float, text_field: str, is_writer: bool, barrier: Callable[[], None],
               is_local_writer: bool | None = None, split: str = "train", revision: str | None = None,
               streaming: bool = False, hash_content: bool = False, num_proc: int | None = None,
               examples: ExampleOptions | None = None, vision: bool = False) -> DataBundle:
    """Train/val blocks of a text source, a prepared directory, or a weighted mixture of them; rows of chat or
    instruction examples when the sources hold those (`examples`: the data.* settings for them). `vision`: records
    with images for a vision-language model, rendered through the processor saved with `tokenizer` (its directory)."""
    examples = examples or ExampleOptions()
    mixture = parse_mixture(source)
    entries = mixture or [(source, 1.0)]
    parts = [source_part(text, split, revision, streaming) for text, _ in entries]
    formats = source_formats(parts, examples)
    fields = [text_field if f == "text" or isinstance(p, Path) else tuple(FIELDS[f]) for p, f in zip(parts, formats)]
    processor = None
    if vision:
        from bigtrain.data.vision import vision_processor
        processor = vision_processor(parts, formats, tokenizer, examples)
        tok, tok_dir = processor.tokenizer, None
    else:
        tok, tok_dir = _tokenizer(parts, tokenizer, vocab_size, tokenizer_dir, fields, is_writer, barrier)
    template_from_data = False
    if examples.chat_template:
        tok.chat_template = read_chat_template(examples.chat_template)
    elif not getattr(tok, "chat_template", None) and (made := _prepared_template(parts)):
        tok.chat_template, template_from_data = made, True  # `prepare --chat-template`: the same tokenizer's
    if processor is not None:
        processor.chat_template = tok.chat_template  # data.chat_template's too: prepare renders with the processor
    check_template(formats, tok)  # every rank says so, before any prepares
    writers = (is_writer, is_writer if is_local_writer is None else is_local_writer)
    options = {"text_field": text_field, "hash_content": hash_content, "num_proc": num_proc, "seq_len": seq_len,
               "processor": processor}
    corpora = [_corpus(part, tok, cache_dir, writers, barrier, {**options, "fmt": f})
               for part, f in zip(parts, formats)]
    if formats[0] != "text":
        from bigtrain.data.examples import build_examples
        from bigtrain.data.pairs import build_pairs, build_unpaired
        from bigtrain.data.prompt_rows import build_prompts
        _same_template(corpora, tok, examples)
        build = (build_pairs if formats[0] in PAIR_FORMATS else build_unpaired if formats[0] in UNPAIRED_FORMATS
                 else build_prompts if formats[0] in PROMPT_FORMATS else build_examples)
        if processor is not None:
            from bigtrain.data.vision_rows import check_image_cuts
            check_image_cuts(corpora, seq_len, examples.prompt_tokens if build is build_prompts else None,
                             examples.long_examples)
        bundle = build(corpora, [text for text, _ in entries], [w for _, w in mixture] if mixture else None,
                                seq_len, examples, val_fraction, tok)
        if processor is not None:
            from bigtrain.data.vision_rows import image_stats, with_images
            bundle.stats.update(image_stats(corpora))
            bundle.description += (f"; {bundle.stats['images_per_example']:.2g} images and "
                                   f"{bundle.stats['image_tokens_per_example']:.4g} image tokens a record")
            bundle = with_images(bundle, processor)
        bundle.tokenizer_dir = corpora[0].tokenizer_dir if examples.chat_template or template_from_data else tok_dir
        bundle.template_from_data = template_from_data
        bundle.prompts = prompt_rendering(corpora)
        return bundle
    blocks = [TokenBlocks(corpus, seq_len) for corpus in corpora]
    for (text, _), corpus in zip(entries, corpora):
        if block_count(corpus.num_tokens, seq_len) < 2:
            raise ValueError(f"data.source={text!r} has {corpus.num_tokens} tokens: fewer than 2 blocks of "
                             f"data.seq_len={seq_len} + 1 (one to train, one to validate); use more text or a "
                             "shorter seq_len")
    splits = [split_rows(len(b), val_fraction) for b in blocks]
    trains = [b.subset(train) for b, (train, _) in zip(blocks, splits)]
    vals = [b.subset(val) for b, (_, val) in zip(blocks, splits)]
    tokens = sum(c.num_tokens for c in corpora)
    desc = (f"text {source!r}: {tokens:,} tokens, vocab {len(tok)}, {sum(map(len, trains))} train / "
            f"{sum(map(len, vals))} val blocks of {seq_len}+1 tokens, from {', '.join(str(c.root) for c in corpora)}")
    if mixture is None:
        return DataBundle(trains[0], vals[0], tok, len(tok), 0, desc, tokenizer_dir=tok_dir,
                          prompts=prompt_rendering(corpora))
    weights = [w for _, w in mixture]
    desc += "; mixture weights " + ", ".join(f"{w:.3g}" for w in weights)

    def make_sampler(rank: int, size: int, seed: int) -> MixtureSampler:
        return MixtureSampler([len(t) for t in trains], weights, rank, size, seed)

    return DataBundle(ConcatRows(trains), ConcatRows(vals), tok, len(tok), 0, desc, make_sampler, tok_dir,
                      prompts=prompt_rendering(corpora))


def source_part(text: str, split: str, revision: str | None, streaming: bool) -> Part:
    path = Path(text).expanduser()
    if is_prepared(path):
        return path
    if path.is_dir() and (path / PLAN_FILE).is_file():
        read_manifest(path)  # raises: an unfinished prepare, with the command that finishes it
    return text_source(text, split, revision, streaming)


def source_formats(parts: list[Part], options: ExampleOptions) -> list[str]:
    """Each part's format: text, or an example format (a prepared one's manifest says; data.format or the first
    record of a source); ValueError for text mixed with examples, or packing asked of text."""
    found = []
    for part in parts:
        if isinstance(part, Path):
            made = (read_manifest(part).get("examples") or {}).get("format", "text")
            if options.format not in ("auto", made):
                raise ValueError(f"data.format={options.format}: {part} was prepared as {made}; set data.format="
                                 f"{made} (or auto), or prepare the source again with --format {options.format}")
            found.append(made)
        else:
            found.append(detect_format(part, options.format))
    kinds = {"text" if f == "text" else "pairs" if f in PAIR_FORMATS else "unpaired" if f in UNPAIRED_FORMATS
             else "prompts" if f in PROMPT_FORMATS else "examples" for f in found}
    if len(kinds) > 1:
        raise ValueError("data.source mixes " + " with ".join(sorted(KIND_NAMES[k] for k in kinds)) +
                         f" ({', '.join(sorted(set(found)))}); train on one kind at a time")
    if found[0] in PROMPT_FORMATS and options.packing:
        raise ValueError("data.packing=true with prompt records: each prompt is generated from on its own row; set "
                         "data.packing=false")
    if (found[0] in PAIR_FORMATS or found[0] in UNPAIRED_FORMATS) and options.packing:
        raise ValueError("data.packing=true with preference data: each answer is scored on its own row; set "
                         "data.packing=false")
    if found[0] == "text" and options.packing:
        raise ValueError(_packing_text_line(parts))
    return found


def _packing_text_line(parts: list[Part]) -> str:
    """data.packing=true on data read as plain text: records of no example format say their keys (a misspelt
    'messages'), an unreadable first record says so; only true plain text is told to turn packing off."""
    from bigtrain.data.formats import EXAMPLE_FORMATS, layout_of, record_shapes
    from bigtrain.data.sources import first_keys
    for part in parts:
        if isinstance(part, Source) and part.kind == "files" and part.loader != "text":
            keys = first_keys(part)
            where = str(part.files[0]) if part.files else part.text
            if keys is None:
                return (f"data.packing=true packs chat and instruction examples, and no first record could be read "
                        f"from {where} (empty, or not JSON records): give a file of records")
            shapes = record_shapes(f for f in EXAMPLE_FORMATS if layout_of(f) == "rows")  # what packs: examples
            return (f"data.packing=true packs chat and instruction examples, and the records of {where} are of no "
                    f"such format (they have {', '.join(map(repr, keys))}): give records with {shapes} "
                    "(data.format), or set data.packing=false to train their text field as plain text")
    return ("data.packing=true packs chat and instruction examples; this data is plain text, which trains in full "
            "blocks already: set data.packing=false (or data.format for records)")


def _prepared_template(parts: list[Part]) -> str | None:
    """The chat template a prepared part was rendered with (`bigtrain prepare --chat-template`, saved with its
    tokenizer), for a run whose own tokenizer has none: that corpus's tokenizer is the run's (`_tokenizer` compares
    their fingerprints) with the template added."""
    from bigtrain.data.tokenizer import load_tokenizer
    for part in parts:
        if isinstance(part, Path) and (read_manifest(part).get("examples") or {}).get("format") in TEMPLATED:
            if made := getattr(load_tokenizer(part / "tokenizer"), "chat_template", None):
                return made
    return None


def _same_template(corpora: list[PreparedCorpus], tok: Any, options: ExampleOptions) -> None:
    """A prepared chat corpus was rendered with one template: data.chat_template must not silently differ."""
    import hashlib
    if not options.chat_template:
        return
    wanted = hashlib.sha256(str(tok.chat_template).encode()).hexdigest()[:16]
    for corpus in corpora:
        made = corpus.manifest["identity"].get("chat_template")
        if made is not None and made != wanted:
            raise ValueError(f"{corpus.root} was prepared with another chat template than data.chat_template; "
                             f"prepare it again with --chat-template, or leave data.chat_template unset")


def _tokenizer(parts: list[Part], name: str | None, vocab_size: int, tokenizer_dir: Path, fields: list,
               is_writer: bool, barrier: Callable[[], None]) -> tuple[Any, Path | None]:
    """The named tokenizer; else a prepared part's; else a BPE trained on the sources (by the writer)."""
    # imported here: transformers takes seconds, and `source_part`/`source_formats` are asked before any rank starts
    from bigtrain.data.tokenizer import load_tokenizer, resolve_tokenizer, tokenizer_fingerprint
    prepared = [p for p in parts if isinstance(p, Path)]
    if name is None and prepared:
        tok, tok_dir = load_tokenizer(prepared[0] / "tokenizer"), prepared[0] / "tokenizer"
    else:
        sources = [(p, f) for p, f in zip(parts, fields) if isinstance(p, Source)]
        share = BPE_TRAIN_BYTES // max(1, len(sources))
        texts = lambda: itertools.chain.from_iterable(iter_documents(s, f, share) for s, f in sources)  # noqa: E731
        tok = resolve_tokenizer(name, tokenizer_dir, vocab_size, texts, is_writer, barrier)
        tok_dir = tokenizer_dir if name is None else None
    fingerprint = tokenizer_fingerprint(tok)
    for path in prepared:
        made_with = read_manifest(path)["tokenizer"]
        if made_with["fingerprint"] != fingerprint:
            ours = getattr(tok, "name_or_path", "") or "?"
            raise ValueError(f"{path} was prepared with another tokenizer ({made_with['name']!r}) than this run's "
                             f"({ours!r}); prepare it again with `bigtrain prepare --tokenizer {ours}` (a pretrained "
                             f"model reads only its own tokenizer's ids), or, for a model built here, set "
                             f"data.tokenizer={str(path / 'tokenizer')!r}")
    return tok, tok_dir


def _corpus(part: Part, tok: Any, cache_dir: Path, writers: tuple[bool, bool], barrier: Callable[[], None],
            options: dict) -> PreparedCorpus:
    """A prepared directory as it is; a source prepared into the cache by rank 0 (or, where the cache is not
    shared with rank 0, by the node's local rank 0) while the other ranks wait."""
    if isinstance(part, Path):
        return PreparedCorpus(part)
    ident = identity(part, tok, options["text_field"], options["hash_content"], options["fmt"], options["processor"])
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]
    target = Path(cache_dir) / f"prepared-{key}"
    for writes in writers:  # the second round finds the corpus already there unless the cache is node-local
        if writes and not is_complete(target):  # absent, or a shard deleted since: (re)made, intact shards kept
            prepare(part, tok, target, **options)
        barrier()
    return PreparedCorpus(target)
