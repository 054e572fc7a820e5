"""Chat and instruction data: rendering through the chat template, the answer mask token by token,
prompt/completion and Alpaca masks, format recognition, long examples truncated or dropped and counted, and
prepare's shards (tokens + mask) made in worker processes, resumable."""
from __future__ import annotations

import json

import numpy as np
import pytest

from local_chat import LLAMA_TEMPLATE_TAGGED, conversations, make_chat_tokenizer, write_jsonl
from messages import naming

from bigtrain.data import build_data
from bigtrain.data.chat import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT, Renderer
from bigtrain.data.formats import ExampleOptions, format_of
from bigtrain.data.prepare import PreparedCorpus

TWO_TURNS = [{"role": "system", "content": "answer briefly"},
             {"role": "user", "content": "what is two plus two"},
             {"role": "assistant", "content": "the answer is four"},
             {"role": "user", "content": "and the cat"}, {"role": "assistant", "content": "it sat on a mat"}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("chat") / "tokenizer"
    make_chat_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def tok(tok_dir):
    from bigtrain.data.tokenizer import load_tokenizer
    return load_tokenizer(tok_dir)


def expected_two_turns(tok) -> tuple[list[int], list[int]]:
    """The conversation's tokens and answer mask built by hand, segment by segment, from the template's pieces:
    the assistant's tokens are its content and its <|eot_id|>; its header (the generation prompt) is prompt."""
    def enc(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    ids, mask = enc("<|begin_of_text|>"), [0]
    for message in TWO_TURNS:
        header = enc(f"<|start_header_id|>{message['role']}<|end_header_id|>\n\n")
        body = enc(message["content"] + "<|eot_id|>")
        ids += header + body
        mask += [0] * len(header) + [int(message["role"] == "assistant")] * len(body)
    return ids, mask


def test_a_two_turn_conversation_trains_exactly_the_assistant_tokens(tok, tok_dir, tmp_path):
    ids, mask = expected_two_turns(tok)
    got_ids, got_mask = Renderer(tok, "chat")(dict(messages=TWO_TURNS))
    assert got_ids == ids and got_mask == mask  # token by token
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "the answer is four<|eot_id|>it sat on a mat<|eot_id|>"
    # a template that marks the answers itself ({% generation %}) goes through transformers' assistant mask
    tagged = make_chat_tokenizer(tmp_path / "tagged", LLAMA_TEMPLATE_TAGGED)
    assert Renderer(tagged, "chat").tagged and Renderer(tagged, "chat")(dict(messages=TWO_TURNS)) == (ids, mask)
    # one whose block holds the answer's text alone, the end of the turn after it: that token is trained too (it was
    # not, and a model trained so never learns to stop)
    short = LLAMA_TEMPLATE_TAGGED.replace("{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}",
                                          "{{ message['content'] | trim }}{% endgeneration %}{{ '<|eot_id|>' }}")
    assert short != LLAMA_TEMPLATE_TAGGED
    content_only = make_chat_tokenizer(tmp_path / "content_only", short)
    assert Renderer(content_only, "chat")(dict(messages=TWO_TURNS)) == (ids, mask)

    # the same conversation prepared and served: labels are the answer tokens, -100 elsewhere
    source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": TWO_TURNS}] * 3 + conversations(20))
    bundle = build_data(str(source), seq_len=128, tokenizer=str(tok_dir), cache_dir=tmp_path / "cache",
                        tokenizer_dir=tmp_path / "t", num_proc=1, val_fraction=0.1)
    row = next(i for i in range(len(bundle.train)) if bundle.train.take([i])["input_ids"][0, :len(ids)].tolist() == ids)
    batch = bundle.train.take([row])
    labels = batch["labels"][0].tolist()
    assert labels[:len(ids)] == [t if m else -100 for t, m in zip(ids, mask)]
    assert set(labels[len(ids):]) == {-100} and "position_ids" not in batch  # padding; unpacked
    assert bundle.stats["format"] == "chat" and bundle.stats["examples"] == 23


def test_sharegpt_conversations_train_like_the_same_messages(tok, tok_dir, tmp_path):
    """ShareGPT records (axolotl's and LLaMA-Factory's "conversations" of from/value) are recognised and render to
    the tokens and answer mask of the same conversation given as messages; an unknown speaker is one line."""
    speaker = {"system": "system", "user": "human", "assistant": "gpt"}
    shared = {"conversations": [{"from": speaker[m["role"]], "value": m["content"]} for m in TWO_TURNS]}
    assert format_of(shared) == "sharegpt"
    assert Renderer(tok, "sharegpt")(shared) == Renderer(tok, "chat")({"messages": TWO_TURNS})
    source = write_jsonl(tmp_path / "sharegpt.jsonl", [shared] * 20)
    bundle = build_data(str(source), seq_len=128, tokenizer=str(tok_dir), cache_dir=tmp_path / "cache",
                        tokenizer_dir=tmp_path / "t", num_proc=1, val_fraction=0.1)
    ids, mask = expected_two_turns(tok)
    assert bundle.stats["format"] == "sharegpt"
    assert bundle.train.take([0])["labels"][0, :len(ids)].tolist() == [t if m else -100 for t, m in zip(ids, mask)]
    with pytest.raises(ValueError) as err:
        Renderer(tok, "sharegpt")({"conversations": [{"from": "narrator", "value": "once"}]})
    assert naming(str(err.value), "'narrator'", "human", "gpt", "messages")


def test_messages_a_template_would_render_wrongly_are_one_line_and_text_parts_are_joined(tok):
    """An unknown role, a null or non-text content would render as a stray header, an empty answer or a Python
    repr that trains; OpenAI-style text parts render as their text."""
    user = {"role": "user", "content": "what is two plus two"}
    parts = [user, {"role": "assistant", "content": [{"type": "text", "text": "the answer "}, {"type": "text",
                                                                                               "text": "is four"}]}]
    assert Renderer(tok, "chat")({"messages": parts}) == Renderer(tok, "chat")(
        {"messages": [user, {"role": "assistant", "content": "the answer is four"}]})
    for bad, named in [({"role": "bot", "content": "hi"}, ("'bot'", "assistant", "data.format=sharegpt")),
                       ({"role": "assistant", "content": None}, ("'assistant'", "NoneType", "not text")),
                       ({"role": "assistant", "content": [{"type": "image_url", "url": "x"}]}, ("image_url", "text"))]:
        with pytest.raises(ValueError) as err:
            Renderer(tok, "chat")({"messages": [user, bad]})
        assert naming(str(err.value), *named), err.value


def test_prompt_completion_and_alpaca_train_on_the_answer_and_its_end_of_text(tok):
    eos = tok.eos_token_id

    def enc(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    ids, mask = Renderer(tok, "prompt_completion")({"prompt": "what is two plus two?", "completion": " four"})
    assert ids == enc("what is two plus two?") + enc(" four") + [eos]
    assert mask == [0] * len(enc("what is two plus two?")) + [1] * (len(enc(" four")) + 1)
    ids, mask = Renderer(tok, "alpaca")({"instruction": "add", "input": "two and two", "output": "four"})
    prompt = ALPACA_PROMPT.format(instruction="add", input="two and two")
    assert ids == enc(prompt) + enc("four") + [eos] and sum(mask) == len(enc("four")) + 1 and mask[-1] == 1
    ids, _ = Renderer(tok, "alpaca")({"instruction": "add", "output": "four"})
    assert ids[:len(enc(ALPACA_PROMPT_NO_INPUT.format(instruction="add")))] == enc(
        ALPACA_PROMPT_NO_INPUT.format(instruction="add"))
    with pytest.raises(ValueError) as err:
        Renderer(tok, "prompt_completion")({"prompt": "x", "completion": ["not", "text"]})
    assert naming(str(err.value), "'completion'", "list")


def test_the_format_is_recognised_from_the_records_or_set_and_mistakes_are_one_line(tok, tok_dir, tmp_path):
    assert format_of({"messages"}) == "chat" and format_of({"prompt", "completion"}) == "prompt_completion"
    assert format_of({"instruction", "input", "output"}) == "alpaca" and format_of({"text", "id"}) == "text"
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": f"q{i} what", "completion": " four"} for i in range(30)])
    common = dict(seq_len=64, tokenizer=str(tok_dir), cache_dir=tmp_path / "cache", tokenizer_dir=tmp_path / "t",
                  num_proc=1)
    bundle = build_data(str(pairs), **common)
    assert bundle.stats["format"] == "prompt_completion" and bundle.stats["examples"] == 30
    with pytest.raises(ValueError) as err:  # records of another format than the one set
        build_data(str(pairs), **common, examples=ExampleOptions(format="chat"))
    assert naming(str(err.value), "pairs.jsonl", "messages", "data.format")
    # a tokenizer without a chat template: one line naming data.chat_template; given one (a file), it trains
    bare = make_chat_tokenizer(tmp_path / "bare", template="")
    bare.chat_template = None
    bare.save_pretrained(str(tmp_path / "bare"))
    chats = write_jsonl(tmp_path / "chats.jsonl", conversations(30))
    with pytest.raises(ValueError) as err:
        build_data(str(chats), **{**common, "tokenizer": str(tmp_path / "bare")})
    assert naming(str(err.value), "data.chat_template")
    template_file = tmp_path / "template.jinja"
    template_file.write_text(tok.chat_template)
    bundle = build_data(str(chats), **{**common, "tokenizer": str(tmp_path / "bare")},
                        examples=ExampleOptions(chat_template=str(template_file)))
    assert bundle.stats["format"] == "chat" and bundle.tokenizer.chat_template == tok.chat_template
    with pytest.raises(ValueError) as err:
        ExampleOptions(long_examples="cut")
    assert naming(str(err.value), "data.long_examples", "truncate", "drop")


def test_examples_longer_than_seq_len_are_truncated_or_dropped_and_counted(tok_dir, tmp_path):
    records = conversations(60, max_words=30)
    source = write_jsonl(tmp_path / "long.jsonl", records)
    common = dict(seq_len=48, tokenizer=str(tok_dir), cache_dir=tmp_path / "cache", tokenizer_dir=tmp_path / "t",
                  num_proc=1, val_fraction=0.1)
    corpus_lengths = None
    for mode in ("truncate", "drop"):
        bundle = build_data(str(source), **common, examples=ExampleOptions(long_examples=mode))
        stats = bundle.stats
        if corpus_lengths is None:
            corpus = PreparedCorpus(next((tmp_path / "cache").glob("prepared-*")))
            corpus_lengths = np.diff(corpus.document_ends(), prepend=0)
        long = int((corpus_lengths > 48).sum())
        assert 0 < long < 60 and stats["too_long"] == long
        kept = stats["train_examples"] + stats["val_examples"]
        if mode == "truncate":  # cut to 48 tokens; those whose answer starts past the cut have nothing to train
            assert stats["truncated"] + stats["dropped_no_answer"] == long and kept == 60 - stats["dropped_no_answer"]
        else:
            assert stats["dropped_too_long"] == long and kept == 60 - long - stats["dropped_no_answer"]
        assert f"{long} longer than data.seq_len=48" in bundle.description
        for i in range(len(bundle.train)):
            labels = bundle.train.take([i])["labels"][0]
            assert (labels != -100).any()  # every row trains on something


def test_examples_without_an_answer_and_records_of_no_format_get_the_advice_that_fixes_them(tok_dir, tmp_path):
    """No assistant turn at all is not a seq_len problem; records in none of the shapes are not a text_field one
    alone: each line names what fixes it."""
    common = dict(seq_len=64, tokenizer=str(tok_dir), cache_dir=tmp_path / "cache", tokenizer_dir=tmp_path / "t",
                  num_proc=1)
    asked = [{"messages": [{"role": "user", "content": f"question {i}"}]} for i in range(20)]
    with pytest.raises(ValueError) as err:
        build_data(str(write_jsonl(tmp_path / "asked.jsonl", asked)), **common)
    assert naming(str(err.value), "20 have none at all", "assistant turn", "data.train_on_prompt"), err.value
    assert "raise data.seq_len" not in str(err.value)
    one_unanswered = [*conversations(30), asked[0]]
    bundle = build_data(str(write_jsonl(tmp_path / "mixed.jsonl", one_unanswered)), **common)
    assert bundle.stats["no_answer"] == 1 and "1 without an answer (no assistant turn" in bundle.description
    pairs = [{"question": f"q{i}", "answer": "a"} for i in range(20)]
    with pytest.raises(ValueError) as err:
        build_data(str(write_jsonl(tmp_path / "qa.jsonl", pairs)), **common)
    assert naming(str(err.value), "data.text_field", "'answer', 'question'", "'messages'", "'prompt' + 'completion'",
                  "data.format"), err.value


def test_train_on_prompt_trains_every_token_but_each_examples_first(tok_dir, tmp_path):
    source = write_jsonl(tmp_path / "chat.jsonl", conversations(20))
    bundle = build_data(str(source), seq_len=96, tokenizer=str(tok_dir), cache_dir=tmp_path / "cache",
                        tokenizer_dir=tmp_path / "t", num_proc=1, examples=ExampleOptions(train_on_prompt=True))
    batch = bundle.train.take([0])
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    real = int((labels != -100).sum()) + 1  # the first token is never a target
    assert labels[0] == -100 and (labels[1:real] == ids[1:real]).all() and (labels[real:] == -100).all()
    assert "every token" in bundle.description


def test_prepare_writes_tokens_and_masks_in_worker_processes_and_resumes(tok, tok_dir, tmp_path, capsys):
    from bigtrain.data.prepare.cli import main

    records = conversations(400)
    source = write_jsonl(tmp_path / "chat.jsonl", records)
    argv = ["--data", str(source), "--tokenizer", str(tok_dir), "--quiet", "--seq-len", "48"]
    assert main([*argv, "--out", str(tmp_path / "one"), "--num-proc", "1"]) == 0
    printed = capsys.readouterr().out
    assert "chat examples" in printed and "longer than seq_len 48" in printed
    many = [*argv, "--out", str(tmp_path / "many"), "--num-proc", "2", "--piece-mb", "0.01"]
    assert main(many) == 0
    a, b = PreparedCorpus(tmp_path / "one"), PreparedCorpus(tmp_path / "many")
    assert len(b.manifest["shards"]) > 2 and a.manifest["examples"] == b.manifest["examples"]
    assert np.array_equal(a.tokens(0, a.num_tokens), b.tokens(0, b.num_tokens))
    assert np.array_equal(a.mask(0, a.num_tokens), b.mask(0, b.num_tokens))
    assert np.array_equal(a.document_ends(), b.document_ends()) and a.manifest["num_docs"] == 400
    ids, mask = Renderer(tok, "chat")(records[7])
    start = int(a.document_ends()[6])
    assert a.tokens(start, start + len(ids)).tolist() == ids and a.mask(start, start + len(ids)).tolist() == mask
    # a shard's mask lost: the same command makes that shard again and keeps the others
    (tmp_path / "many" / "shards" / "00001.mask.bin").unlink()
    assert main(many) == 0
    manifest = json.loads((tmp_path / "many" / "manifest.json").read_text())
    assert manifest["resumed_shards"] == len(manifest["shards"]) - 1
    assert np.array_equal(PreparedCorpus(tmp_path / "many").mask(0, a.num_tokens), a.mask(0, a.num_tokens))


def test_chat_records_from_jsonl_json_parquet_and_the_hub_give_the_same_examples(tok, tmp_path, monkeypatch):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from bigtrain.data import sources
    from bigtrain.data.sources import detect_format
    from bigtrain.data.prepare import prepare, text_source

    records = conversations(24)
    jsonl = write_jsonl(tmp_path / "c.jsonl", records)
    (tmp_path / "c.json").write_text(json.dumps(records))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "c.parquet", row_group_size=5)
    monkeypatch.setattr(sources, "hub_reachable", lambda timeout=3.0: True)
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config=None, **kw: datasets.Dataset.from_list(records))
    made = []
    for name in ("c.jsonl", "c.json", "c.parquet", "hf:org/chats"):
        src = text_source(name if name.startswith("hf:") else str(tmp_path / name))
        assert detect_format(src, "auto") == "chat"
        corpus = prepare(src, tok, tmp_path / f"out-{name.replace(':', '_').replace('/', '_')}", progress=False,
                         fmt="chat")
        made.append((corpus.tokens(0, corpus.num_tokens).tolist(), corpus.mask(0, corpus.num_tokens).tolist(),
                     corpus.document_ends().tolist()))
    expected = [Renderer(tok, "chat")(r) for r in records]
    assert made[0][0] == sum((ids for ids, _ in expected), []) and made[0][1] == sum((m for _, m in expected), [])
    assert all(m == made[0] for m in made[1:])


def test_packing_where_it_cannot_work_is_one_line(tok_dir, tmp_path):
    from bigtrain.config.run_config import DataConfig, PipelineConfig, RunConfig

    with pytest.raises(ValueError) as err:
        RunConfig(data=DataConfig(packing=True), pipeline=PipelineConfig(stages=2))
    assert naming(str(err.value), "data.packing=true", "pipeline.stages=2")
    text = tmp_path / "plain.txt"
    text.write_text("the cat sat on the mat. " * 200)
    with pytest.raises(ValueError) as err:
        build_data(str(text), seq_len=32, tokenizer=str(tok_dir), cache_dir=tmp_path / "cache",
                   tokenizer_dir=tmp_path / "t", num_proc=1, examples=ExampleOptions(packing=True))
    assert naming(str(err.value), "data.packing", "plain text")
    with pytest.raises(ValueError) as err:
        build_data(str(text), seq_len=32, tokenizer=str(tok_dir), cache_dir=tmp_path / "cache",
                   tokenizer_dir=tmp_path / "t", num_proc=1, examples=ExampleOptions(format="chat"))
    assert naming(str(err.value), "data.format=chat", "plain.txt")
    # records of no format (a misspelt 'messages') and an empty file were told "plain text: set data.packing=false",
    # and the run after that fix gave the real line
    misspelt = write_jsonl(tmp_path / "msgs.jsonl", [{"msgs": c["messages"]} for c in conversations(5)])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for source, needles in ((misspelt, ["msgs.jsonl", "'msgs'", "'messages'", "data.format"]),
                            (empty, ["empty.jsonl", "no first record"])):
        with pytest.raises(ValueError) as err:
            build_data(str(source), seq_len=32, tokenizer=str(tok_dir), cache_dir=tmp_path / "cache",
                       tokenizer_dir=tmp_path / "t", num_proc=1, examples=ExampleOptions(packing=True))
        assert naming(str(err.value), "data.packing=true", *needles) and "this data is plain text" not in str(err.value)


def test_a_word_level_vocabulary_without_an_unknown_token_renders(tmp_path):
    """Such a tokenizer encodes its own words and fails on any other ("a" among them): bigtrain's own probe for the
    tokens put before a text raised the tokenizers library's error, a traceback from prepare and train."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = ["<s>", "</s>", "<pad>", "hello", "there", "fine", "thanks", "user:", "assistant:"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}))  # no unk_token
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% if m['role'] == 'assistant' %}"
                         " </s>{% endif %} {% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    ids, mask = Renderer(tok, "chat").chat([{"role": "user", "content": "hello there"},
                                            {"role": "assistant", "content": "fine thanks"}])
    assert tok.decode([i for i, m in zip(ids, mask) if m]).split() == ["fine", "thanks", "</s>"]


def test_a_corpus_prepared_with_a_chat_template_trains_with_a_tokenizer_that_has_none(tok, tmp_path):
    """docs/data.md's route for a base model without a template: `bigtrain prepare --chat-template FILE`, then train
    on the prepared folder. The run was refused, before and on the ranks, for the model's tokenizer lacking the
    template the corpus was rendered with; now it takes the corpus's (the same tokenizer, its template added), and
    that is the tokenizer the run records for export."""
    from bigtrain.config.load import load_run_config
    from bigtrain.data.prepare.cli import main as prepare_main
    from bigtrain.train.precheck import check_text_data
    bare = make_chat_tokenizer(tmp_path / "bare", template="")
    bare.chat_template = None
    bare.save_pretrained(str(tmp_path / "bare"))
    template = tmp_path / "template.jinja"
    template.write_text(tok.chat_template)
    chats = write_jsonl(tmp_path / "chats.jsonl", conversations(30))
    prepared = tmp_path / "prepared"
    assert prepare_main(["--data", str(chats), "--tokenizer", str(tmp_path / "bare"), "--chat-template",
                         str(template), "--out", str(prepared), "--num-proc", "1"]) == 0
    run = load_run_config(None, [f"data.source={prepared}", f"data.tokenizer={tmp_path / 'bare'}", "data.seq_len=64"])
    check_text_data(run)  # before any rank: no refusal
    bundle = build_data(str(prepared), "text", seq_len=64, tokenizer=str(tmp_path / "bare"),
                        cache_dir=tmp_path / "cache", tokenizer_dir=tmp_path / "t")
    assert bundle.template_from_data and bundle.tokenizer.chat_template == tok.chat_template
    assert bundle.tokenizer_dir == prepared / "tokenizer" and bundle.stats["examples"] > 0


def test_a_record_that_does_not_render_is_named_by_its_line(tok_dir, tmp_path):
    """An empty conversation on line 12 was shown, but not where it was: a bad JSON line and a missing field named
    theirs."""
    records = conversations(20)
    records.insert(11, {"messages": []})
    source = write_jsonl(tmp_path / "chats.jsonl", records)
    with pytest.raises(ValueError) as err:
        build_data(str(source), seq_len=64, tokenizer=str(tok_dir), cache_dir=tmp_path / "cache",
                   tokenizer_dir=tmp_path / "t", num_proc=1)
    assert naming(str(err.value), "chats.jsonl line 12", '{"messages": []}', "non-empty list"), err.value
