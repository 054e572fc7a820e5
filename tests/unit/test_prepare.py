"""Prepare (token shards in bounded memory, resumable), prepared data in training, mixtures, hub options."""
from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from messages import naming

from bigtrain.data import build_data, ensure_tokenizer, load_tokenizer, sources
from bigtrain.data.builtin import builtin_documents
from bigtrain.data.mixture import CHUNK, MixtureSampler, chunk_counts, parse_mixture
from bigtrain.data.prepare import PreparedCorpus, is_prepared, prepare, text_source
from bigtrain.data.prepare.core import identity

DOCS = builtin_documents()[:40]  # real prose, ~200 KB


def reference_stream(docs: list[str], tok) -> list[int]:
    """What bigtrain's in-run path built before prepare existed: each document tokenized, an EOS after each."""
    return sum((tok.encode(d, add_special_tokens=False) + [tok.eos_token_id] for d in docs), [])


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "n": i}) + "\n" for i, d in enumerate(docs)))
    return path


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok") / "tokenizer"
    ensure_tokenizer(directory, lambda: DOCS, vocab_size=400)
    return load_tokenizer(directory)


@pytest.fixture(scope="module")
def kill_corpus(tmp_path_factory):
    """~0.9 MB of jsonl: about 37 pieces of 0.015 MB (cut at line ends)."""
    root = tmp_path_factory.mktemp("kill")
    rng = random.Random(0)
    docs = [d[rng.randrange(len(d) // 2):] for d in (rng.choice(DOCS) for _ in range(200))]
    return write_jsonl(root / "corpus.jsonl", docs), docs


# --- prepare: the same tokens as tokenizing in the run, any file type ---------------------------------------

def test_prepared_stream_equals_in_run_tokenization_for_txt_jsonl_parquet_json(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = DOCS[:12]
    expected = reference_stream(docs, tok)
    (tmp_path / "txt").mkdir()
    for i, d in enumerate(docs):
        (tmp_path / "txt" / f"{i:02d}.txt").write_text(d)
    write_jsonl(tmp_path / "d.jsonl", docs)
    pq.write_table(pa.table({"text": docs}), tmp_path / "d.parquet", row_group_size=3)
    (tmp_path / "d.json").write_text(json.dumps([{"text": d} for d in docs]))
    for name, piece_bytes in (("txt", 5000), ("d.jsonl", 10**9), ("d.parquet", 10**9), ("d.json", 10**9)):
        corpus = prepare(str(tmp_path / name), tok, tmp_path / f"out-{name}", piece_bytes=piece_bytes,
                         batch_bytes=2000, progress=False)  # .txt files larger than a batch: encoded in chunks
        stream = corpus.tokens(0, corpus.num_tokens)
        assert stream.dtype == np.uint16 and stream.tolist() == expected, name
        ends = corpus.document_ends()
        assert len(ends) == len(docs) == corpus.manifest["num_docs"] and ends[-1] == len(expected)
        assert (stream[ends - 1] == tok.eos_token_id).all()
        assert (tmp_path / f"out-{name}" / "tokenizer" / "tokenizer.json").is_file()
    assert len(PreparedCorpus(tmp_path / "out-txt").manifest["shards"]) > len(docs)  # files cut into pieces


# --- kill -9 mid-way, resume, same shards ---------------------------------------------------------------------

def _prepare_in_own_session(corpus: str, tok_dir: str, out: str) -> None:
    os.setsid()  # its own process group: the test kills it and its workers together, like kill -9 of a job
    prepare(corpus, load_tokenizer(tok_dir), out, num_proc=2, piece_bytes=15_000, progress=False)


def test_kill_9_mid_way_then_resume_gives_the_shards_of_an_uninterrupted_prepare(tmp_path, tok, kill_corpus):
    import multiprocessing

    corpus_path, docs = kill_corpus
    tok.save_pretrained(tmp_path / "tok")
    out = tmp_path / "killed"
    # forked: the child has transformers imported already (a fresh `bigtrain prepare` would spend seconds on it)
    child = multiprocessing.get_context("fork").Process(target=_prepare_in_own_session,
                                                        args=(str(corpus_path), str(tmp_path / "tok"), str(out)))
    child.start()
    deadline = time.time() + 120
    while len(list((out / "shards").glob("*.json"))) < 3:
        assert child.is_alive() and time.time() < deadline, child.exitcode
        time.sleep(0.01)
    os.killpg(child.pid, signal.SIGKILL)  # the prepare and its workers, mid-way
    child.join()
    done_before = len(list((out / "shards").glob("*.json")))
    assert not is_prepared(out) and done_before < 25
    with pytest.raises(ValueError, match="not a prepared corpus .*run `bigtrain prepare"):
        build_data(str(out), "text", seq_len=16, cache_dir=tmp_path / "cache", tokenizer_dir=tmp_path / "t")

    resumed = prepare(str(corpus_path), tok, out, num_proc=1, piece_bytes=15_000, progress=False)
    fresh = prepare(str(corpus_path), tok, tmp_path / "fresh", num_proc=1, piece_bytes=15_000, progress=False)
    assert resumed.manifest["resumed_shards"] >= 3 and fresh.manifest["resumed_shards"] == 0
    assert resumed.manifest["shards"] == fresh.manifest["shards"] and len(fresh.manifest["shards"]) > 30
    for shard in fresh.manifest["shards"]:
        for suffix in (".bin", ".idx.npy"):
            a, b = (d / "shards" / f"{shard['name']}{suffix}" for d in (out, tmp_path / "fresh"))
            assert a.read_bytes() == b.read_bytes(), a
    assert resumed.tokens(0, resumed.num_tokens).tolist() == reference_stream(docs, tok)
    assert not list(out.rglob(".*.tmp"))  # half-written files of the killed run are gone


# --- memory stays flat whatever the corpus size ---------------------------------------------------------------

def test_peak_memory_stays_flat_while_a_corpus_many_times_the_bound_streams_through(tmp_path):
    """16 MB of text through 2 workers in 1 MB pieces: after the first pieces the process tree's RSS grows by
    less than `bound`, a quarter of the corpus (the old in-run path held all of it, and its tokens, at once)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    import psutil

    bound, corpus_bytes = 4e6, 16e6
    words = [f"{'abcdefghij'[i % 10] * 20}{i:04d}" for i in range(400)]  # long words: fast to tokenize
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<eos>", "<unk>", *words])}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    word_tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>")
    rng = random.Random(1)
    with open(tmp_path / "big.jsonl", "w") as f:
        while f.tell() < corpus_bytes:
            f.write(json.dumps({"text": " ".join(rng.choices(words, k=2000))}) + "\n")
    me = psutil.Process()
    samples: list[tuple[int, float]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                tree = [me, *me.children(recursive=True)]
                rss = sum(p.memory_info().rss for p in tree)
                samples.append((len(list((tmp_path / "out" / "shards").glob("*.json"))), rss))
            except (psutil.Error, FileNotFoundError):
                pass
            time.sleep(0.02)

    before = me.memory_info().rss  # this test process: pytest, and whatever earlier tests imported (torch)
    thread = threading.Thread(target=watch)
    thread.start()
    try:
        corpus = prepare(str(tmp_path / "big.jsonl"), word_tok, tmp_path / "out", num_proc=2, piece_bytes=10**6,
                         progress=False)
    finally:
        stop.set()
        thread.join()
    assert len(corpus.manifest["shards"]) >= 16 and corpus.num_tokens > 400_000
    early = max(rss for done, rss in samples if done <= 4)
    late = max(rss for done, rss in samples if done > 4)
    print(f"process tree peak RSS: {before / 1e6:.1f} MB before, {early / 1e6:.1f} MB over the first 4 pieces, "
          f"{late / 1e6:.1f} MB over the other {len(corpus.manifest['shards']) - 4} ({corpus_bytes / 1e6:.0f} MB corpus)")
    # flat: the pieces after the first add less than a quarter of the corpus; the workers' own start-up cost
    # (an interpreter and the tokenizer each) is bounded apart from what the test process already held
    assert late - early < bound and late - before < 600e6


# --- training reads prepared data: the same batches and losses as from the source --------------------------

def test_training_on_a_prepared_directory_equals_training_on_the_source(tmp_path, tok):
    from bigtrain.models import build

    write_jsonl(tmp_path / "c.jsonl", DOCS[:20])
    tok.save_pretrained(tmp_path / "tok")
    prepare(str(tmp_path / "c.jsonl"), tok, tmp_path / "prep", progress=False)
    kw = dict(seq_len=32, vocab_size=400, cache_dir=tmp_path / "cache", val_fraction=0.1)
    in_run = build_data(str(tmp_path / "c.jsonl"), "text", tokenizer=str(tmp_path / "tok"),
                        tokenizer_dir=tmp_path / "unused", **kw)
    prepared = build_data(str(tmp_path / "prep"), "text", tokenizer_dir=tmp_path / "unused2", **kw)
    assert prepared.tokenizer_dir == tmp_path / "prep" / "tokenizer" and len(prepared.train) == len(in_run.train)
    spec = build("gpt2", "tiny", vocab_size=400, n_positions=64, seq_len=32)
    torch.manual_seed(0)
    model = spec.build()
    losses = []
    for bundle in (in_run, prepared):
        sampler = bundle.sampler(0, 1, seed=3)
        it = iter(sampler)
        batch = bundle.train.take([next(it) for _ in range(4)])
        losses.append(spec.loss(model(batch["input_ids"]), batch["labels"]).item())
        assert batch["labels"].shape == (4, 33)
    assert losses[0] == losses[1] and 5.0 < losses[0] < 7.0  # ~ln(400) before training
    # a block of L + 1 tokens trains L positions, each on its next token: transformers' own loss over the block
    hf = model(batch["labels"], labels=batch["labels"]).loss
    torch.testing.assert_close(spec.loss(model(batch["input_ids"]), batch["labels"]), hf, rtol=0, atol=1e-5)


def test_prepared_directory_errors_name_the_fix(tmp_path, tok):
    from transformers import AutoTokenizer

    write_jsonl(tmp_path / "c.jsonl", DOCS[:3])
    prepare(str(tmp_path / "c.jsonl"), tok, tmp_path / "prep", progress=False)
    other = AutoTokenizer.from_pretrained(str(tmp_path / "prep" / "tokenizer"))
    other.add_tokens(["zzzz"])
    with pytest.raises(ValueError, match="prepared with a different tokenizer.*new --out"):
        prepare(str(tmp_path / "c.jsonl"), other, tmp_path / "prep", progress=False)
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match=r"prepared with another tokenizer.*set data.tokenizer="):
        build_data(str(tmp_path / "prep"), "text", seq_len=8, tokenizer=str(tmp_path / "other"),
                   tokenizer_dir=tmp_path / "t", cache_dir=tmp_path / "cache")
    write_jsonl(tmp_path / "body.jsonl", DOCS[:3], field="body")
    with pytest.raises(ValueError, match=r"text_field='text'.*has no such field; it has \['body', 'n'\]"):
        prepare(str(tmp_path / "body.jsonl"), tok, tmp_path / "p2", progress=False)


def test_fingerprint_is_metadata_unless_content_hashing_is_asked_for(tmp_path, tok):
    path = write_jsonl(tmp_path / "c.jsonl", DOCS[:2])
    src = text_source(str(path))
    meta, content = identity(src, tok, "text", False), identity(src, tok, "text", True)
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # same bytes, new mtime
    assert identity(src, tok, "text", False) != meta and identity(src, tok, "text", True) == content


# --- mixtures -------------------------------------------------------------------------------------------------

def test_mixture_spec_parsing():
    assert parse_mixture("a/:0.7,b/:0.3") == [("a/", 0.7), ("b/", 0.3)]
    assert parse_mixture("x:3, y:1") == [("x", 0.75), ("y", 0.25)]
    assert parse_mixture("hf:wikitext:wikitext-2-raw-v1") is None and parse_mixture("data/*.jsonl") is None
    with pytest.raises(ValueError, match="'b/' has no weight"):
        parse_mixture("a/:0.5,b/")
    with pytest.raises(ValueError, match="positive"):
        parse_mixture("a/:0.5,b/:0")
    assert chunk_counts([0.7, 0.3]).tolist() == [7000, 3000] and chunk_counts([1 / 3] * 3).sum() == CHUNK


def test_mixture_counts_match_weights_and_resume_continues_the_order_at_another_dp_size():
    lengths, weights = [50, 3000, 700], [0.5, 0.3, 0.2]
    full = [MixtureSampler(lengths, weights, r, 2, seed=9) for r in range(2)]
    streams = [iter(s) for s in full]
    order = [next(streams[g % 2]) for g in range(24_000)]  # the global order, position by position
    counts = np.bincount([full[0].source_of(i) for i in order], minlength=3) / len(order)
    assert np.abs(counts - weights).max() < 0.01, counts
    small = [i for i in order if i < 50]
    assert sorted(small[:50]) == list(range(50)) and small[:50] != small[50:100]  # each pass a new permutation
    state = json.loads(json.dumps(full[0].state_dict()))  # after 12000 each: 24000 consumed
    one = MixtureSampler(lengths, weights, 0, 1, seed=0)
    one.load_state_dict(state)  # the checkpoint's seed wins
    reference = [MixtureSampler(lengths, weights, r, 2, seed=9) for r in range(2)]
    for s in reference:
        s.position = 12_000
    ref_streams = [iter(s) for s in reference]
    it = iter(one)
    assert [next(it) for _ in range(100)] == [next(ref_streams[g % 2]) for g in range(100)]
    three = MixtureSampler(lengths, weights, 2, 3, seed=0)
    three.load_state_dict(state)
    assert next(iter(three)) == reference[0].sample_at(24_000 + 2)
    with pytest.raises(ValueError, match="mixture had sources"):
        MixtureSampler([50, 3000, 701], weights, 0, 1, seed=9).load_state_dict(state)


def test_mixture_of_prepared_and_unprepared_sources_through_build_data(tmp_path, tok):
    write_jsonl(tmp_path / "a.jsonl", DOCS[:10])
    write_jsonl(tmp_path / "b.jsonl", DOCS[10:30])
    prepare(str(tmp_path / "a.jsonl"), tok, tmp_path / "a", progress=False)
    bundle = build_data(f"{tmp_path / 'a'}:0.25,{tmp_path / 'b.jsonl'}:0.75", "text", seq_len=16,
                        tokenizer_dir=tmp_path / "t", cache_dir=tmp_path / "cache")
    sampler = bundle.sampler(0, 1, seed=1)
    it = iter(sampler)
    picks = [next(it) for _ in range(2000)]
    share_a = np.mean([sampler.source_of(i) == 0 for i in picks])
    assert abs(share_a - 0.25) < 0.03 and "mixture weights 0.25, 0.75" in bundle.description
    batch = bundle.train.take(picks[:6])
    assert batch["input_ids"].shape == (6, 16) and torch.equal(batch["input_ids"], batch["labels"][:, :-1])
    assert len(bundle.val) > 0 and bundle.val.take([0, len(bundle.val) - 1])["labels"].shape == (2, 17)


# --- hub sources: split / revision / streaming, offline in one line -------------------------------------------

def test_hub_options_reach_load_dataset_and_streaming_prepares_the_same_tokens(tmp_path, tok, monkeypatch):
    import datasets

    path = write_jsonl(tmp_path / "h.jsonl", DOCS[:8])
    calls = []
    real = datasets.load_dataset

    def fake(name, config=None, **kw):
        calls.append((name, config, kw["split"], kw["revision"], kw["streaming"]))
        return real("json", data_files=[str(path)], split="train", streaming=kw["streaming"],
                    cache_dir=str(tmp_path / "hf"))

    monkeypatch.setattr(sources, "hub_reachable", lambda timeout=3.0: True)
    monkeypatch.setattr(datasets, "load_dataset", fake)
    streams = []
    for streaming in (False, True):
        src = text_source("hf:org/corpus:cfg", split="validation", revision="abc123", streaming=streaming)
        corpus = prepare(src, tok, tmp_path / f"s{streaming}", progress=False)
        streams.append(corpus.tokens(0, corpus.num_tokens).tolist())
    assert calls == [("org/corpus", "cfg", "validation", "abc123", False), ("org/corpus", "cfg", "validation",
                                                                             "abc123", True)]
    assert streams[0] == streams[1] == reference_stream(DOCS[:8], tok)
    monkeypatch.setattr(sources, "hub_reachable", lambda timeout=3.0: False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    with pytest.raises(ValueError, match="'hf:org/x' needs the Hugging Face Hub, which is unreachable"):
        prepare(text_source("hf:org/x"), tok, tmp_path / "off", progress=False)


def test_prepare_verb_is_registered_and_reports_in_one_line(tmp_path, tok, capsys):
    from bigtrain.cli import build_parser

    write_jsonl(tmp_path / "c.jsonl", DOCS[:5])
    tok.save_pretrained(tmp_path / "tok")
    args = build_parser().parse_args(["prepare", "--data", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "p"),
                                      "--tokenizer", str(tmp_path / "tok"), "--seq-len", "64", "--quiet"])
    assert args.func(args) == 0
    line = capsys.readouterr().out.strip()
    manifest = PreparedCorpus(tmp_path / "p").manifest
    assert line.startswith(f"prepared {tmp_path / 'p'}: "), line
    assert naming(line, "5 documents", f"{manifest['num_tokens']:,} tokens", "uint16"), line
    assert f"{(manifest['num_tokens'] - 1) // 64:,} blocks of seq_len 64" in line
    assert manifest["identity"]["source"] == identity(text_source(str(tmp_path / "c.jsonl")), tok, "text", False)["source"]


def test_prepare_of_a_mixture_says_to_prepare_each_source(tmp_path, capsys):
    """`prepare --data 'a/:0.7,b/:0.3'` said 'no such file or directory' of the whole string (training takes it)."""
    from bigtrain.data.prepare.cli import main as prepare_main
    assert prepare_main(["--data", "a/:0.7,b/:0.3", "--out", str(tmp_path / "p")]) == 2
    line = capsys.readouterr().err.strip()
    assert len(line.splitlines()) == 1 and naming(line, "is a mixture", "prepare takes one source", "--data a/"), line
