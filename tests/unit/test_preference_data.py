"""Preference records: TRL's {prompt, chosen, rejected} as strings or messages (the implicit prompt too)
and LLaMA-Factory's instruction/input/chosen/rejected become pairs of rows whose trained tokens are the answers
only; pairs that teach nothing are dropped and counted; bad records are one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bigtrain.data import build_data
from bigtrain.data.chat import Renderer
from bigtrain.data.formats import ExampleOptions, format_of
from bigtrain.data.pairs import flat_pairs

from local_chat import make_chat_tokenizer, preference_pairs, write_jsonl


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_chat_tokenizer(tmp_path_factory.mktemp("tok") / "tok")


def trained_text(tok, ids, mask) -> str:
    return tok.decode([i for i, m in zip(ids, mask) if m])


def test_formats_are_recognised_from_the_keys():
    assert format_of({"prompt", "chosen", "rejected"}) == "preference"
    assert format_of({"chosen", "rejected"}) == "preference"  # implicit prompt
    assert format_of({"instruction", "input", "chosen", "rejected"}) == "preference_instruction"
    assert format_of({"prompt", "completion"}) == "prompt_completion"


def test_conversational_pairs_train_the_answers_only(tok):
    record = {"prompt": [{"role": "user", "content": "what is two plus two"}],
              "chosen": [{"role": "assistant", "content": "four"}],
              "rejected": [{"role": "assistant", "content": "the cat"}]}
    (c_ids, c_mask), (r_ids, r_mask) = Renderer(tok, "preference").examples(record)
    assert trained_text(tok, c_ids, c_mask) == "four<|eot_id|>"
    assert trained_text(tok, r_ids, r_mask) == "the cat<|eot_id|>"
    # both sides share the prompt's tokens exactly, as the model sees it when asked
    prompt = tok.apply_chat_template(record["prompt"], add_generation_prompt=True, tokenize=False)
    shared = len(tok(prompt, add_special_tokens=False)["input_ids"])
    assert c_ids[:shared] == r_ids[:shared] and not any(c_mask[:shared])
    # a string prompt is the user's turn
    as_text = Renderer(tok, "preference").examples({**record, "prompt": "what is two plus two"})
    assert as_text == [(c_ids, c_mask), (r_ids, r_mask)]


def test_an_implicit_prompt_is_the_turns_both_conversations_share(tok):
    user = {"role": "user", "content": "hello there"}
    first = {"role": "assistant", "content": "good morning"}
    again = {"role": "user", "content": "how are you"}
    record = {"chosen": [user, first, again, {"role": "assistant", "content": "fine thanks"}],
              "rejected": [user, first, again, {"role": "assistant", "content": "no"}]}
    (c_ids, c_mask), (_, r_mask) = Renderer(tok, "preference").examples(record)
    assert trained_text(tok, c_ids, c_mask) == "fine thanks<|eot_id|>"  # not the shared "good morning" turn
    with pytest.raises(ValueError, match="same turns"):
        Renderer(tok, "preference").examples({"chosen": record["chosen"], "rejected": record["chosen"]})


def test_text_pairs_and_instruction_pairs(tok):
    tok.eos_token = "<|eot_id|>"
    (ids, mask), _ = Renderer(tok, "preference").examples({"prompt": "two plus two is", "chosen": " four",
                                                            "rejected": " five"})
    assert trained_text(tok, ids, mask) == " four<|eot_id|>"
    (ids, mask), (_, r_mask) = Renderer(tok, "preference_instruction").examples(
        {"instruction": "add", "input": "two and two", "chosen": "four", "rejected": "five"})
    assert "### Instruction:\nadd" in tok.decode(ids) and trained_text(tok, ids, mask) == "four<|eot_id|>"
    with pytest.raises(ValueError, match="needs a text 'prompt'"):
        Renderer(tok, "preference").examples({"chosen": "four", "rejected": "five"})


def test_pairs_become_rows_side_by_side_and_pairs_that_teach_nothing_are_dropped(tmp_path, tok):
    records = preference_pairs(40)
    records[3]["rejected"] = records[3]["chosen"]  # the same answer twice: nothing to prefer
    data = write_jsonl(tmp_path / "pairs.jsonl", records)
    tok.save_pretrained(str(tmp_path / "tok"))
    bundle = build_data(str(data), "text", seq_len=48, tokenizer=str(tmp_path / "tok"), cache_dir=tmp_path / "cache",
                        tokenizer_dir=tmp_path / "t", examples=ExampleOptions())
    assert bundle.layout == "pairs" and bundle.stats["dropped_same_answers"] == 1
    assert bundle.stats["train_pairs"] + bundle.stats["val_pairs"] == 39
    batch = bundle.train.take([0, 1, 2])
    assert batch["input_ids"].shape == (3, 2, 48) and batch["labels"].shape == (3, 2, 48)
    rows = flat_pairs(batch)
    assert torch.equal(rows["input_ids"][:3], batch["input_ids"][:, 0])  # chosen rows first
    assert torch.equal(rows["input_ids"][3:], batch["input_ids"][:, 1])
    chosen = [tok.decode([t for t in row if t != -100]) for row in batch["labels"][:, 0].tolist()]
    rejected = [tok.decode([t for t in row if t != -100]) for row in batch["labels"][:, 1].tolist()]
    assert all(c.startswith("yes") for c in chosen) and all(r.startswith("no") for r in rejected)


def test_a_pair_of_a_text_answer_and_a_message_answer_is_one_line(tok):
    """One side rendered through the chat template and the other as plain text: the two answers followed different
    prompts, and prepare and train exited 0."""
    record = {"prompt": "how is the dog", "chosen": " fine",
              "rejected": [{"role": "assistant", "content": "bad"}]}
    with pytest.raises(ValueError, match="'chosen' is a str and its 'rejected' a list: give both as strings or both"):
        Renderer(tok, "preference").examples(record)


def test_pairs_the_same_within_seq_len_are_dropped_and_cut_ones_are_counted(tmp_path, tok):
    """Answers that differ only past data.seq_len train as the same rows: dropped (they were kept), and the pairs cut
    to seq_len are in the data line (they were only in summary.json)."""
    tok.save_pretrained(str(tmp_path / "tok"))
    long_tail = " yes" * 40
    records = [{"prompt": "p", "chosen": " yes" + long_tail + " cat", "rejected": " yes" + long_tail + " dog"}] * 3
    records += preference_pairs(20, conversational=False)
    data = write_jsonl(tmp_path / "pairs.jsonl", records)
    bundle = build_data(str(data), "text", seq_len=24, tokenizer=str(tmp_path / "tok"), cache_dir=tmp_path / "cache",
                        tokenizer_dir=tmp_path / "t", examples=ExampleOptions())
    assert bundle.stats["dropped_same_answers"] == 3 and bundle.stats["too_long"] >= 3
    assert "3 with the same chosen and rejected answer within seq_len" in bundle.description
    cut = bundle.stats["too_long"] - bundle.stats["dropped_too_long"]
    assert f"{cut} with a side longer than data.seq_len=24 truncated" in bundle.description, bundle.description


def test_no_pair_that_can_train_is_one_line(tmp_path, tok):
    tok.save_pretrained(str(tmp_path / "tok"))
    records = [{"prompt": "a", "chosen": " same", "rejected": " same"}] * 5
    data = write_jsonl(tmp_path / "same.jsonl", records)
    with pytest.raises(ValueError, match="every pair's chosen and rejected answers are the same tokens"):
        build_data(str(data), "text", seq_len=32, tokenizer=str(tmp_path / "tok"), cache_dir=tmp_path / "cache",
                   tokenizer_dir=tmp_path / "t")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "chosen": " b", "rejected": 3}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl.*'rejected' is int"):
        build_data(str(bad), "text", seq_len=32, tokenizer=str(tmp_path / "tok"), cache_dir=tmp_path / "cache2",
                   tokenizer_dir=tmp_path / "t", examples=ExampleOptions(format="preference"))


def test_packing_pairs_and_mixing_pairs_with_chats_are_refused(tmp_path, tok):
    tok.save_pretrained(str(tmp_path / "tok"))
    pairs = write_jsonl(tmp_path / "pairs.jsonl", preference_pairs(10))
    chats = write_jsonl(tmp_path / "chats.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                                 {"role": "assistant", "content": "hello"}]}] * 10)
    common = dict(seq_len=32, tokenizer=str(tmp_path / "tok"), cache_dir=tmp_path / "cache",
                  tokenizer_dir=tmp_path / "t")
    with pytest.raises(ValueError, match="data.packing=false"):
        build_data(str(pairs), "text", examples=ExampleOptions(packing=True), **common)
    with pytest.raises(ValueError, match="mixes chat/instruction examples with preference pairs"):
        build_data(f"{pairs}:0.5,{chats}:0.5", "text", **common)


def test_kto_answers_carry_their_label_and_sit_beside_another_answer_for_the_kl_estimate(tmp_path, tok):
    from bigtrain.data.formats import UNDESIRABLE
    tok.save_pretrained(str(tmp_path / "tok"))
    record = {"prompt": [{"role": "user", "content": "hello there"}],
              "completion": [{"role": "assistant", "content": "good morning"}], "label": False}
    ((ids, mask),) = Renderer(tok, "kto").examples(record)
    assert set(mask) == {0, UNDESIRABLE} and trained_text(tok, ids, mask) == "good morning<|eot_id|>"
    with pytest.raises(ValueError, match="'label' is 'yes'"):
        Renderer(tok, "kto").examples({**record, "label": "yes"})
    assert format_of({"prompt", "completion", "label"}) == "kto"
    records = [{"prompt": f"question {i}", "completion": f" answer {i}", "label": i % 3 != 0} for i in range(30)]
    bundle = build_data(str(write_jsonl(tmp_path / "kto.jsonl", records)), "text", seq_len=32,
                        tokenizer=str(tmp_path / "tok"), cache_dir=tmp_path / "cache", tokenizer_dir=tmp_path / "t")
    assert bundle.layout == "unpaired" and bundle.stats["desirable"] == 20
    batch = bundle.train.take([0, 1, 2])
    text = lambda row: tok.decode([t for t in row if t != tok.pad_token_id])  # noqa: E731
    answers = [text(batch["input_ids"][b, 0].tolist()) for b in range(3)]
    counterparts = [text(batch["input_ids"][b, 1].tolist()) for b in range(3)]
    for b in range(3):  # its own prompt, the next answer in the batch
        prompt = answers[b].split(" answer")[0]
        assert counterparts[b] == prompt + " answer" + answers[(b + 1) % 3].split(" answer")[1]
    labels = [int(a.split("answer ")[1].split("<")[0]) % 3 != 0 for a in answers]
    assert batch["desirable"].tolist() == labels


# --- padding: pad != end-of-text ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def own_pad(tmp_path_factory) -> dict[str, Path]:
    """A tokenizer whose pad (<|endoftext|>) is not its end-of-text (<|eot_id|>), as Qwen2's, a tiny Llama saved
    with it (its config.json naming the end-of-text as its pad, as some directories do), and pairs and KTO data."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("own_pad")
    tok = make_chat_tokenizer(root / "llama", own_pad=True)
    torch.manual_seed(3)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                 pad_token_id=tok.eos_token_id)).save_pretrained(root / "llama")
    pairs = preference_pairs(20)
    kto = [{"prompt": p["prompt"], "completion": p["chosen" if i % 2 else "rejected"], "label": bool(i % 2)}
           for i, p in enumerate(pairs)]
    return {"llama": root / "llama", "pairs": write_jsonl(root / "pairs.jsonl", pairs),
            "kto": write_jsonl(root / "kto.jsonl", kto), "root": root}


def rows_at(own_pad: dict[str, Path], data: str, seq_len: int) -> dict[str, torch.Tensor]:
    """Every held-out row of `data`, padded to seq_len ([2n, seq_len]: pairs' chosen then rejected, or KTO's answers
    then their KL counterparts)."""
    bundle = build_data(str(own_pad[data]), "text", seq_len=seq_len, tokenizer=str(own_pad["llama"]),
                        cache_dir=own_pad["root"] / f"cache_{data}_{seq_len}", tokenizer_dir=own_pad["root"] / "t",
                        val_fraction=0.25)
    return flat_pairs(bundle.val.take(list(range(len(bundle.val)))))


@pytest.mark.parametrize("data", ["pairs", "kto"])
def test_rows_are_padded_with_the_tokenizers_pad_and_score_the_same_at_any_length(own_pad, data):
    """The pad is the tokenizer's, not its end-of-text; a row's answer log-probabilities (DPO's, IPO's, ORPO's,
    SimPO's, KTO's and the precomputed reference's, which read these rows) are the same padded to 64 or to 128."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bigtrain.models.losses import answer_logps
    tok = AutoTokenizer.from_pretrained(own_pad["llama"])
    short, long = rows_at(own_pad, data, 64), rows_at(own_pad, data, 128)
    assert torch.equal(long["input_ids"][:, :64], short["input_ids"])  # the same rows, more padding
    tail = long["input_ids"][:, 64:]
    assert (tail == tok.pad_token_id).all() and tok.pad_token_id != tok.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(own_pad["llama"]).eval()
    with torch.no_grad():
        at_64, counts_64 = answer_logps(model(short["input_ids"]).logits, short["labels"])
        at_128, counts_128 = answer_logps(model(long["input_ids"]).logits, long["labels"])
    assert torch.equal(counts_64, counts_128) and bool((counts_64 > 0).all())
    assert torch.allclose(at_64, at_128, atol=1e-5, rtol=0), (at_64 - at_128).abs().max()


def test_a_reward_head_reads_each_row_where_transformers_reads_the_conversation_alone(own_pad):
    """The reward model's spec as a run builds it (the directory's config names the end-of-text as its pad; the
    run's overrides give the tokenizer's pad, which the rows are padded with): a row's reward is the reward of its
    conversation alone, without padding, at 64 and at 128."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from bigtrain.config.load import load_run_config
    from bigtrain.models import build
    from bigtrain.train.inputs import overrides_for_run

    tok = AutoTokenizer.from_pretrained(own_pad["llama"])
    run = load_run_config(None, ["model.family=hf", f"model.pretrained={own_pad['llama']}", "data.seq_len=128",
                                 "objective.kind=reward"])
    data = SimpleNamespace(tokenizer=tok, vocab_size=len(tok), num_classes=0)  # what the run's data says
    spec = build("hf", "custom", **overrides_for_run(run, data, "cpu"))
    assert spec.config.pad_token_id == tok.pad_token_id != tok.eos_token_id
    torch.manual_seed(0)
    model = spec.build(seed=0).eval()
    short, long = rows_at(own_pad, "pairs", 64), rows_at(own_pad, "pairs", 128)
    lengths = (short["input_ids"] != tok.pad_token_id).sum(-1)
    with torch.no_grad():
        at_64, at_128 = model(short["input_ids"]).logits[:, 0], model(long["input_ids"]).logits[:, 0]
        alone = torch.stack([model(row[None, :n]).logits[0, 0] for row, n in zip(short["input_ids"], lengths)])
    assert torch.allclose(at_64, alone, atol=1e-5, rtol=0) and torch.allclose(at_128, alone, atol=1e-5, rtol=0)
    assert float(alone.std()) > 1e-3  # rows that differ score differently: the comparison means something


def test_the_pad_falls_back_to_the_end_of_text_when_the_tokenizer_has_none(own_pad):
    from transformers import AutoTokenizer

    from bigtrain.data.tokenizer import pad_id
    tok = AutoTokenizer.from_pretrained(own_pad["llama"])
    assert pad_id(tok) == tok.pad_token_id
    tok.pad_token = None
    assert tok.pad_token_id is None and pad_id(tok) == tok.eos_token_id  # as TRL's trainers fall back
