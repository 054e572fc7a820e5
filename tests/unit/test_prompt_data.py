"""Prompt-only records for online RL (bigtrain/data/prompts.py, prompt_rows.py; data.format=prompt): prepared
through `bigtrain prepare`'s machinery (worker processes, the run's cache, a prepared directory read as it is),
every other column kept whole for the reward functions, prompts rendered as TRL renders them (a text after the
tokenizer's start tokens; a conversation through the chat template with the generation prompt), left-padded,
long ones cut on the left or dropped and counted, the order resumable; a record without a prompt is one line.

Each would catch: a column lost or changed (a nested answer, a number), records misaligned with their prompts
across shards and workers, a prompt without its generation prompt, a long prompt cut on the wrong side, right
padding, and a traceback instead of a line."""
from __future__ import annotations

import json

import pytest

from local_chat import make_chat_tokenizer, write_jsonl
from messages import naming

from bigtrain.data import build_data
from bigtrain.data.formats import ExampleOptions

QUESTIONS = ["what is two plus two", "tell me about rivers", "the cat sat on a mat", "good morning",
             "please tell me about the sea and the mountains and rivers", "how are you"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("prompts") / "tokenizer"
    make_chat_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def tok(tok_dir):
    from bigtrain.data.tokenizer import load_tokenizer
    return load_tokenizer(tok_dir)


def records(n: int) -> list[dict]:
    """Text and conversational prompts alternating, each with columns a reward reads."""
    out = []
    for i in range(n):
        question = QUESTIONS[i % len(QUESTIONS)] + f" number {i}"
        prompt = question if i % 2 else [{"role": "system", "content": "answer briefly"},
                                         {"role": "user", "content": question}]
        out.append({"prompt": prompt, "answer": str(i * 7), "id": i, "meta": {"level": i % 3, "tags": ["x", i]}})
    return out


def bundle_of(source, tok_dir, tmp_path, **options):
    prompt_tokens = options.pop("prompt_tokens", 120)  # what a generating objective asks: seq_len 128 - 8 to answer
    return build_data(str(source), seq_len=128, tokenizer=str(tok_dir), cache_dir=tmp_path / "cache",
                      tokenizer_dir=tmp_path / "t", val_fraction=0.1, num_proc=options.pop("num_proc", 1),
                      examples=ExampleOptions(format="prompt", prompt_tokens=prompt_tokens, **options))


def expected_ids(tok, prompt) -> list[int]:
    if isinstance(prompt, str):  # TRL: processing_class(text=prompts)
        return tok(prompt)["input_ids"]
    text = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")  # the model answers from here
    return tok(text, add_special_tokens=False)["input_ids"]


def check_served(bundle, tok, source_records: list[dict]) -> None:
    """Every prompt of both splits: its tokens as TRL renders them, left-padded, and its record whole."""
    seen = []
    for rows in (bundle.train, bundle.val):
        batch = rows.take(list(range(len(rows))))
        assert batch["prompt_mask"][:, -1].all()  # left padding: every prompt ends at the last column
        for ids, mask, record in zip(batch["prompt_ids"], batch["prompt_mask"],
                                     rows.records(batch["prompt_index"].tolist())):
            assert record == source_records[record["id"]]
            assert ids[mask.bool()].tolist() == expected_ids(tok, record["prompt"])
            assert mask.tolist() == sorted(mask.tolist())  # 0s, then 1s
            seen.append(record["id"])
    assert sorted(seen) == list(range(len(source_records)))


def test_prompt_records_keep_their_columns_and_render_as_trl_does(tok, tok_dir, tmp_path):
    data = records(40)
    bundle = bundle_of(write_jsonl(tmp_path / "prompts.jsonl", data), tok_dir, tmp_path)
    assert bundle.layout == "prompts" and bundle.stats["prompts"] == 40 and bundle.stats["too_long"] == 0
    assert (len(bundle.train), len(bundle.val)) == (36, 4)
    check_served(bundle, tok, data)
    assert isinstance(bundle.sample_prompt, list) and bundle.sample_prompt


def test_workers_parquet_and_json_arrays_keep_records_aligned(tok, tok_dir, tmp_path):
    """Several pieces tokenized by 2 worker processes (the records written beside each shard), then a Parquet
    file and a JSON array: the same prompts and records each way."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from bigtrain.data.prepare import prepare
    data = records(60)
    source = write_jsonl(tmp_path / "many.jsonl", data)
    prepared = prepare(str(source), tok, tmp_path / "prepared", num_proc=2, piece_bytes=2000, progress=False,
                       fmt="prompt")
    assert len(prepared.manifest["shards"]) > 3
    check_served(bundle_of(tmp_path / "prepared", tok_dir, tmp_path), tok, data)
    # Parquet: a column holds one type (text prompts; the nested column as JSON text)
    flat = [{**r, "prompt": r["prompt"] if isinstance(r["prompt"], str) else r["prompt"][-1]["content"],
             "meta": json.dumps(r["meta"])} for r in data]
    pq.write_table(pa.Table.from_pylist(flat), tmp_path / "prompts.parquet", row_group_size=7)
    check_served(bundle_of(tmp_path / "prompts.parquet", tok_dir, tmp_path / "pq"), tok, flat)
    (tmp_path / "array.json").write_text(json.dumps(data))
    check_served(bundle_of(tmp_path / "array.json", tok_dir, tmp_path / "arr"), tok, data)


def test_long_prompts_are_cut_on_the_left_or_dropped_and_counted(tok, tok_dir, tmp_path):
    data = records(30)
    source = write_jsonl(tmp_path / "prompts.jsonl", data)
    lengths = {r["id"]: len(expected_ids(tok, r["prompt"])) for r in data}
    limit = sorted(lengths.values())[len(lengths) // 2]  # about half are longer
    long = sum(n > limit for n in lengths.values())
    cut = bundle_of(source, tok_dir, tmp_path, prompt_tokens=limit)
    assert cut.stats["too_long"] == cut.stats["cut_too_long"] == long and cut.stats["dropped_too_long"] == 0
    batch = cut.train.take(list(range(len(cut.train))))
    assert batch["prompt_ids"].shape[1] == limit
    for ids, mask, record in zip(batch["prompt_ids"], batch["prompt_mask"],
                                 cut.train.records(batch["prompt_index"].tolist())):
        full = expected_ids(tok, record["prompt"])
        assert ids[mask.bool()].tolist() == full[-limit:]  # the end kept: the question and generation prompt
    dropped = bundle_of(source, tok_dir, tmp_path / "drop", prompt_tokens=limit, long_examples="drop")
    assert dropped.stats["dropped_too_long"] == long and len(dropped.train) + len(dropped.val) == 30 - long
    with pytest.raises(ValueError) as info:
        bundle_of(source, tok_dir, tmp_path / "none", prompt_tokens=0)
    assert naming(str(info.value), "seq_len", "max_completion_length")
    with pytest.raises(ValueError) as info:  # no objective that generates asked for prompts: SFT on them is refused
        bundle_of(source, tok_dir, tmp_path / "sft", prompt_tokens=None)
    assert naming(str(info.value), "data.format=prompt", "objective")


def test_the_order_resumes(tok_dir, tmp_path):
    bundle = bundle_of(write_jsonl(tmp_path / "prompts.jsonl", records(40)), tok_dir, tmp_path)
    sampler = bundle.sampler(0, 1, seed=3)
    it = iter(sampler)
    [next(it) for _ in range(50)]  # into the second epoch
    state = sampler.state_dict()
    expected = [next(it) for _ in range(10)]
    resumed = bundle.sampler(0, 1, seed=99)
    resumed.load_state_dict(state)
    assert [next(iter(resumed)) for _ in range(10)] == expected


def test_mistakes_are_one_line(tok_dir, tmp_path):
    def error(data, **options) -> str:
        source = write_jsonl(tmp_path / f"bad{len(list(tmp_path.iterdir()))}.jsonl", data)
        with pytest.raises(ValueError) as info:
            bundle_of(source, tok_dir, tmp_path / source.stem, **options)
        message = str(info.value)
        assert "\n" not in message and "Traceback" not in message
        return message

    missing = error(records(5) + [{"question": "where is my prompt", "answer": "4"}] + records(3))
    assert naming(missing, "prompt", "line 6")
    assert naming(error([{"prompt": 42, "answer": 1}] * 4), "'prompt' is int", "messages")
    assert "empty" in error([{"prompt": "  "}] * 4)
    assert "packing" in error(records(4), packing=True)
    (tmp_path / "plain.txt").write_text("just text\n")
    with pytest.raises(ValueError, match="plain text, not records"):
        bundle_of(tmp_path / "plain.txt", tok_dir, tmp_path / "txt")


def test_a_prepared_corpus_missing_its_records_is_one_line(tok, tok_dir, tmp_path):
    from bigtrain.data.prepare import prepare
    prepare(str(write_jsonl(tmp_path / "p.jsonl", records(10))), tok, tmp_path / "prepared", num_proc=1,
            progress=False, fmt="prompt")
    (tmp_path / "prepared" / "shards" / "00000.records.jsonl").unlink()
    with pytest.raises(ValueError) as info:
        bundle_of(tmp_path / "prepared", tok_dir, tmp_path)
    assert naming(str(info.value), "00000.records.jsonl", "prepare")
