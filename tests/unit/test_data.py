"""Data layer: sources, tokenizer, blocks, split, cache, sampler, loaders, synthetic and images
(prepare, mixtures and memory: test_prepare.py; two ranks sharing one tokenizer and cache:
tests/dist/test_data_ranks.py)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bigtrain.data import (ResumableSampler, batches, build_data, ensure_tokenizer, iter_eval_batches,
                           load_tokenizer, split_rows)
from bigtrain.data import sources, text
from bigtrain.data.builtin import builtin_classification, builtin_documents
from bigtrain.data.images import MEAN, STD
from bigtrain.data.sources import load_texts, parse_source
from bigtrain.data.tokenizer import EOS, has_tokenizer, train_bpe

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 8 + "A second sentence about foxes and dogs.\n",
    "Packing joins documents with an end-of-text token between them so that blocks are full.\n" * 6,
    "Python's if statement selects exactly one suite by evaluating expressions one by one.\n" * 5,
]


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok") / "tokenizer"
    ensure_tokenizer(directory, lambda: CORPUS, vocab_size=320)
    return load_tokenizer(directory)


def _write_txt(root: Path) -> list[Path]:
    paths = []
    for i, doc in enumerate(CORPUS):
        paths.append(root / f"doc{i}.txt")
        paths[-1].write_text(doc)
    return paths


# --- sources ---------------------------------------------------------------------------------

def test_builtin_corpus_is_real_python_docs_in_fixed_order():
    docs = builtin_documents()
    assert len(docs) > 50 and sum(map(len, docs)) > 300_000
    assert any('The "if" statement' in d for d in docs)
    assert docs == builtin_documents()


def test_default_build_trains_on_builtin_text(tmp_path):
    bundle = build_data(tokenizer_dir=tmp_path / "tok", cache_dir=tmp_path / "cache")  # no network needed
    assert len(bundle.train) > 300 and len(bundle.val) >= 15 and bundle.vocab_size == 4096
    block = bundle.tokenizer.decode(bundle.train.take([0])["input_ids"][0])
    assert len(block.split()) > 100 and "the" in block.split()


def test_builtin_classification_gives_each_text_one_label():
    texts, labels, names = builtin_classification(10)
    assert len(names) == 10 and sorted(set(labels)) == list(range(10))
    assert len(set(texts)) == len(texts) > 500
    with pytest.raises(ValueError, match="num_classes=500"):
        builtin_classification(500)


def test_txt_jsonl_parquet_and_glob_sources_load_the_same_texts(tmp_path):
    _write_txt(tmp_path)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"body": d, "n": i}) + "\n" for i, d in enumerate(CORPUS)))
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"body": CORPUS}), tmp_path / "d.parquet")
    cache = tmp_path / "cache"
    txt = parse_source(str(tmp_path / "doc*.txt"), "text")
    assert txt.loader == "text" and [f.name for f in txt.files] == ["doc0.txt", "doc1.txt", "doc2.txt"]
    assert load_texts(txt, "ignored", cache) == CORPUS  # one document per .txt file, newlines kept
    for name in ("d.jsonl", "d.parquet"):
        assert load_texts(parse_source(str(tmp_path / name), "text"), "body", cache) == CORPUS
    with pytest.raises(ValueError, match=r"text_field='text'.*has no such column.*'body'"):
        load_texts(parse_source(str(tmp_path / "d.jsonl"), "text"), "text", cache)


def test_bad_sources_raise_value_errors_naming_them(tmp_path):
    with pytest.raises(ValueError, match="nope.txt.*no such file"):
        parse_source(str(tmp_path / "nope.txt"), "text")
    with pytest.raises(ValueError, match=r"\*.jsonl.*matches no"):
        parse_source(str(tmp_path / "*.jsonl"), "text")
    (tmp_path / "a.csv").write_text("x")
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        parse_source(str(tmp_path / "a.csv"), "text")
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "b.jsonl").write_text("{}")
    with pytest.raises(ValueError, match="mixes file types"):
        parse_source(str(tmp_path), "text")
    with pytest.raises(ValueError, match="image folder"):
        parse_source(str(tmp_path / "a.txt"), "image")
    with pytest.raises(ValueError, match="modality 'audio'"):
        build_data("synthetic", "audio")


def test_hub_source_offline_fails_fast_with_a_clear_message(monkeypatch, tmp_path):
    import datasets
    monkeypatch.setattr(sources, "hub_reachable", lambda timeout=3.0: False)
    # datasets reads HF_HUB_OFFLINE once, at import: a test file that imported it offline before this one (pytest
    # runs files in one process) would otherwise turn the unreachable Hub into an offline cache lookup
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    with pytest.raises(ValueError, match="'hf:wikitext:wikitext-2-raw-v1' needs the Hugging Face Hub"):
        build_data("hf:wikitext:wikitext-2-raw-v1", tokenizer_dir=tmp_path / "t", cache_dir=tmp_path / "c")
    src = parse_source("hf:org/name:cfg", "text")
    assert (src.kind, src.name, src.config) == ("hub", "org/name", "cfg")


# --- tokenizer -------------------------------------------------------------------------------

def test_a_trained_bpe_is_kept_per_corpus_and_copied_by_the_next_run(tmp_path, monkeypatch):
    """The next run on the same text copies the BPE the last one trained (the same file, byte for byte, as a
    training gives), another corpus or vocabulary trains its own, and a cache that cannot be written costs only
    the time."""
    import bigtrain.data.tokenizer as tokenizer_module
    monkeypatch.setenv("BIGTRAIN_CACHE", str(tmp_path / "cache"))
    first = ensure_tokenizer(tmp_path / "run1" / "tokenizer", lambda: CORPUS, vocab_size=320)
    trained = list((tmp_path / "cache" / "tokenizers").iterdir())
    assert len(trained) == 1 and has_tokenizer(trained[0])

    def no_training(*args, **kwargs):
        raise AssertionError("trained again although the cache holds this corpus's BPE")
    monkeypatch.setattr(tokenizer_module, "train_bpe", no_training)
    second = ensure_tokenizer(tmp_path / "run2" / "tokenizer", lambda: CORPUS, vocab_size=320)
    assert (second / "tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()
    monkeypatch.undo()

    monkeypatch.setenv("BIGTRAIN_CACHE", "off")
    fresh = ensure_tokenizer(tmp_path / "run3" / "tokenizer", lambda: CORPUS, vocab_size=320)
    assert (fresh / "tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()

    monkeypatch.setenv("BIGTRAIN_CACHE", str(tmp_path / "cache"))
    ensure_tokenizer(tmp_path / "run4" / "tokenizer", lambda: CORPUS[:2], vocab_size=320)  # another corpus
    ensure_tokenizer(tmp_path / "run5" / "tokenizer", lambda: CORPUS, vocab_size=300)  # another vocabulary
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 3

    (tmp_path / "readonly").write_text("a file where the cache's folder would be")
    monkeypatch.setenv("BIGTRAIN_CACHE", str(tmp_path / "readonly"))
    kept = ensure_tokenizer(tmp_path / "run6" / "tokenizer", lambda: CORPUS, vocab_size=320)
    assert (kept / "tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()


def test_bpe_is_deterministic_reloads_identically_and_loads_with_autotokenizer(tmp_path, small_tokenizer,
                                                                              monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("BIGTRAIN_CACHE", "off")  # trained again here, not copied
    second = ensure_tokenizer(tmp_path / "again", lambda: CORPUS, vocab_size=320)
    assert small_tokenizer.backend_tokenizer.to_str() == load_tokenizer(second).backend_tokenizer.to_str()
    auto = AutoTokenizer.from_pretrained(str(second))
    sample = "The lazy fox packs blocks.\n  Unseen: ünïcødé 123"
    ids = small_tokenizer.encode(sample)
    assert auto.encode(sample) == ids and auto.decode(ids) == sample  # byte-level: lossless on unseen text
    assert len(auto) <= 320 and auto.convert_ids_to_tokens(auto.eos_token_id) == EOS
    called = []
    ensure_tokenizer(second, lambda: called.append(1) or CORPUS, vocab_size=320)
    assert called == []  # idempotent: an existing tokenizer is reused, never retrained
    with pytest.raises(ValueError, match="vocab_size=100"):
        train_bpe(CORPUS, 100)
    with pytest.raises(ValueError, match="holds no tokenizer"):
        load_tokenizer(tmp_path)


# --- packing, split, cache -------------------------------------------------------------------

def reference_stream(docs: list[str], tok) -> list[int]:
    """What the in-run path of bigtrain 0.1 built: every document tokenized, an EOS after each."""
    return sum((tok.encode(d, add_special_tokens=False) + [tok.eos_token_id] for d in docs), [])


def test_split_is_disjoint_covering_deterministic():
    train, val = split_rows(100, 0.05)
    assert len(val) == 5 and len(train) == 95
    assert set(train).isdisjoint(val) and sorted([*train, *val]) == list(range(100))
    assert val.tolist() == [10, 30, 50, 70, 90] and val.tolist() == split_rows(100, 0.05)[1].tolist()
    assert len(split_rows(3, 0.01)[1]) == 1
    with pytest.raises(ValueError, match="too few"):
        split_rows(1, 0.5)
    big_train, big_val = split_rows(3_400_001, 0.05)  # a 3 GB corpus's blocks: a mask, not a hash of every row
    assert len(big_train) + len(big_val) == 3_400_001 and np.all(np.diff(big_train) > 0)
    assert not np.isin(big_val, big_train).any()


def test_text_blocks_overlap_by_one_token_and_the_prepared_cache_is_reused(tmp_path, monkeypatch):
    _write_txt(tmp_path)
    kw = dict(seq_len=16, vocab_size=320, tokenizer_dir=tmp_path / "tok", cache_dir=tmp_path / "cache",
              val_fraction=0.2)
    bundle = build_data(str(tmp_path / "*.txt"), "text", **kw)
    tok = bundle.tokenizer
    stream = reference_stream(CORPUS, tok)
    n_blocks = (len(stream) - 1) // 16  # blocks of 17 tokens, each sharing its last token with the next
    assert len(bundle.train) + len(bundle.val) == n_blocks and bundle.vocab_size == len(tok)
    train_rows, val_rows = split_rows(n_blocks, 0.2)
    batch = bundle.val.take([0])
    block = torch.tensor(stream[val_rows[0] * 16:val_rows[0] * 16 + 17])
    assert torch.equal(batch["labels"][0], block) and torch.equal(batch["input_ids"][0], block[:16])
    assert batch["input_ids"].dtype == torch.int64 and batch["labels"].shape == (1, 17)
    every = torch.zeros(len(stream), dtype=torch.bool)  # every token but the first is a target exactly once
    for dataset, rows in ((bundle.train, train_rows), (bundle.val, val_rows)):
        labels = dataset.take(range(len(dataset)))["labels"]
        for row, targets in zip(rows, labels[:, 1:]):
            assert targets.tolist() == stream[row * 16 + 1:row * 16 + 17]
            every[row * 16 + 1:row * 16 + 17] = True
    assert every[1:n_blocks * 16 + 1].all() and not every[n_blocks * 16 + 1:].any()
    assert len(list((tmp_path / "cache").glob("prepared-*/manifest.json"))) == 1

    def fail(*a, **k):
        raise AssertionError("prepared again although cached")
    monkeypatch.setattr(text, "prepare", fail)
    again = build_data(str(tmp_path / "*.txt"), "text", **kw)
    assert torch.equal(again.val.take([0])["labels"], batch["labels"])
    other = build_data(str(tmp_path / "*.txt"), "text", **{**kw, "seq_len": 8})  # same shards, other blocks
    assert len(other.train) + len(other.val) == (len(stream) - 1) // 8
    with pytest.raises(ValueError, match="fewer than 2 blocks"):
        build_data(str(tmp_path / "*.txt"), "text", **{**kw, "seq_len": 100_000})


def test_classify_from_jsonl_with_string_labels(tmp_path):
    rows = [{"t": f"{w} example number {i}", "y": w} for i in range(12) for w in ("cats", "dogs", "birds")]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    kw = dict(seq_len=12, vocab_size=300, tokenizer_dir=tmp_path / "tok", cache_dir=tmp_path / "cache",
              text_field="t", label_field="y", val_fraction=0.25)
    bundle = build_data(str(tmp_path / "c.jsonl"), "classify", num_classes=3, **kw)
    assert (len(bundle.train), len(bundle.val), bundle.num_classes) == (27, 9, 3)
    batch = bundle.train.take(range(len(bundle.train)))
    assert batch["input_ids"].shape == (27, 12) and batch["labels"].shape == (27,)
    assert set(batch["labels"].tolist()) == {0, 1, 2}  # sorted names: birds=0, cats=1, dogs=2
    pad = bundle.tokenizer.pad_token_id
    assert (batch["input_ids"][:, -1] == pad).all()  # short texts are padded on the right
    with pytest.raises(ValueError, match="set data.num_classes to 3"):
        build_data(str(tmp_path / "c.jsonl"), "classify", num_classes=2, **kw)


# --- sampler and loaders ---------------------------------------------------------------------

def _take(sampler, n):
    it = iter(sampler)
    return [next(it) for _ in range(n)]


def test_sampler_shards_disjoint_cover_reshuffle_and_seed():
    n, world = 10, 2
    shards = [ResumableSampler(n, r, world, seed=7) for r in range(world)]
    epochs = [[_take(s, 5) for s in shards] for _ in range(2)]  # [epoch][rank] -> 5 indices
    for epoch in epochs:
        assert set(epoch[0]).isdisjoint(epoch[1]) and sorted(epoch[0] + epoch[1]) == list(range(n))
    assert epochs[0] != epochs[1]  # reshuffled per epoch
    assert _take(ResumableSampler(n, 0, world, seed=7), 10) == epochs[0][0] + epochs[1][0]
    assert _take(ResumableSampler(n, 0, world, seed=8), 10) != epochs[0][0] + epochs[1][0]
    odd = ResumableSampler(11, 1, 2, seed=0)
    assert len(odd) == 5 and odd.epoch_order(0).size == 10  # drop_last trims to a multiple of world
    padded = ResumableSampler(11, 1, 2, seed=0, drop_last=False)
    assert len(padded) == 6 and sorted(set(padded.epoch_order(0))) == list(range(11))
    assert _take(ResumableSampler(4, 0, 1, 0, shuffle=False), 6) == [0, 1, 2, 3, 0, 1]
    with pytest.raises(ValueError, match="3 samples cannot give"):
        ResumableSampler(3, 0, 4, seed=0)


@pytest.mark.parametrize("consumed", [3, 7, 14, 20])  # mid-epoch, end of epoch, across the boundary
def test_sampler_resume_continues_exactly(consumed):
    reference = _take(ResumableSampler(15, 1, 2, seed=3), 30)
    first = ResumableSampler(15, 1, 2, seed=3)
    assert _take(first, consumed) == reference[:consumed]
    state = json.loads(json.dumps(first.state_dict()))  # must survive a JSON round trip
    resumed = ResumableSampler(15, 1, 2, seed=999)  # the checkpoint's seed wins
    resumed.load_state_dict(state)
    assert _take(resumed, 30 - consumed) == reference[consumed:]


def test_sampler_resume_at_another_world_size_continues_the_global_order():
    two = [ResumableSampler(12, r, 2, seed=5) for r in range(2)]
    for s in two:
        _take(s, 2)  # 4 of this epoch's global order consumed
    one = ResumableSampler(12, 0, 1, seed=5)
    one.load_state_dict(two[0].state_dict())
    assert _take(one, 8) == one.epoch_order(0)[4:12].tolist()
    with pytest.raises(ValueError, match="data .* changed"):
        one.load_state_dict({**two[0].state_dict(), "num_samples": 13})


def test_batches_resume_exactly_from_sampler_state():
    bundle = build_data("synthetic", "text", seq_len=8, vocab_size=50, synthetic_samples=40, val_fraction=0.1)
    sampler = ResumableSampler(len(bundle.train), 0, 2, seed=1)
    stream = batches(bundle.train, sampler, micro_batch=4)
    head = [next(stream) for _ in range(3)]  # 12 of 18 samples: the 5th batch crosses the epoch end
    state = sampler.state_dict()
    tail = [next(stream) for _ in range(4)]
    resumed_sampler = ResumableSampler(len(bundle.train), 0, 2, seed=1)
    resumed_sampler.load_state_dict(state)
    resumed = batches(bundle.train, resumed_sampler, micro_batch=4)
    for expected in tail:
        got = next(resumed)
        assert torch.equal(got["input_ids"], expected["input_ids"]) and torch.equal(got["labels"], expected["labels"])
    assert not torch.equal(head[0]["input_ids"], tail[0]["input_ids"])


def test_eval_batches_equal_per_rank_and_cover_the_set():
    data = build_data("synthetic", "classify", seq_len=4, vocab_size=40, num_classes=4, synthetic_samples=100,
                      val_fraction=0.13).val  # 13 samples
    per_rank = [list(iter_eval_batches(data, 3, r, 2)) for r in range(2)]
    assert [len(p) for p in per_rank] == [3, 3] and all(b["input_ids"].shape == (3, 4) for p in per_rank for b in p)
    seen = torch.cat([b["input_ids"] for p in per_rank for b in p])
    assert len({tuple(r) for r in seen.tolist()}) == 13  # every val sample evaluated (a few twice)
    assert len(list(iter_eval_batches(data, 3, 0, 2, max_batches=1))) == 1


def test_pipeline_and_data_parallel_steps_see_the_same_samples():
    """The premise of tests/dist/test_equivalence.py's pipeline comparison: per optimizer step, the same set of
    samples in both layouts (dp 2 x micro x accum against one pipeline rank taking twice the accumulation)."""
    def step_sets(dp: int, micro: int, accum: int, steps: int) -> list[set[int]]:
        streams = [iter(ResumableSampler(1000, r, dp, seed=7)) for r in range(dp)]
        return [{next(s) for s in streams for _ in range(micro * accum)} for _ in range(steps)]

    for micro in (4, 1):
        data_parallel = step_sets(dp=2, micro=micro, accum=4 // micro, steps=20)
        pipeline = step_sets(dp=1, micro=micro, accum=8 // micro, steps=20)
        assert data_parallel == pipeline
        assert all(len(s) == 8 for s in pipeline)


# --- synthetic and images --------------------------------------------------------------------

def test_synthetic_batches_shapes_dtypes_and_determinism():
    for modality, keys in (("text", {"input_ids": (5, 16), "labels": (5, 16)}),
                           ("classify", {"input_ids": (5, 16), "labels": (5,)}),
                           ("image", {"pixel_values": (5, 3, 8, 8), "labels": (5,)})):
        kw = dict(seq_len=16, vocab_size=100, image_size=8, num_classes=4, synthetic_samples=50, seed=11)
        a, b = build_data("synthetic", modality, **kw), build_data("synthetic", modality, **kw)
        batch = a.train.take(range(5))
        assert {k: tuple(v.shape) for k, v in batch.items()} == keys
        assert all(torch.equal(batch[k], b.train.take(range(5))[k]) for k in keys)
        assert not torch.equal(batch[next(iter(keys))], build_data("synthetic", modality, **{**kw, "seed": 12})
                               .train.take(range(5))[next(iter(keys))])
        assert batch["labels"].dtype == torch.int64 and int(batch["labels"].max()) < 100
        if modality == "image":
            assert batch["pixel_values"].dtype == torch.float32 and a.num_classes == 4


def test_image_folder_resized_cropped_normalized(tmp_path):
    from PIL import Image

    colors = {"blue": (0, 0, 255), "red": (255, 0, 0)}
    for name, color in colors.items():
        (tmp_path / "img" / name).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (20 + 4 * i, 12), color).save(tmp_path / "img" / name / f"{i}.png")
    bundle = build_data(str(tmp_path / "img"), "image", image_size=8, num_classes=2, val_fraction=0.34,
                        cache_dir=tmp_path / "cache")
    assert (len(bundle.train), len(bundle.val), bundle.vocab_size) == (4, 2, 0)
    batch = bundle.train.take(range(4))
    assert batch["pixel_values"].shape == (4, 3, 8, 8) and batch["pixel_values"].dtype == torch.float32
    for pixels, label in zip(batch["pixel_values"], batch["labels"].tolist()):
        color = list(colors.values())[label]  # classes sorted by folder name: blue=0, red=1
        expected = torch.tensor([(c / 255 - m) / s for c, m, s in zip(color, MEAN, STD)]).view(3, 1, 1)
        assert torch.allclose(pixels, expected.expand(3, 8, 8), atol=1e-5)
    assert len(list((tmp_path / "cache").glob("images-*/pixel_values.npy"))) == 1
    for split, count in (("train", 3), ("test", 1)):  # a folder with its own splits keeps them
        for name, color in colors.items():
            (tmp_path / "split" / split / name).mkdir(parents=True)
            for i in range(count):
                Image.new("RGB", (9, 9), color).save(tmp_path / "split" / split / name / f"{i}.png")
    split = build_data(str(tmp_path / "split"), "image", image_size=8, num_classes=2, cache_dir=tmp_path / "cache")
    assert (len(split.train), len(split.val)) == (6, 2)
    assert sorted(split.val.take([0, 1])["labels"].tolist()) == [0, 1]
