"""A reward model as a user trains and uses it: a tiny Llama directory with a tokenizer whose pad is not
its end-of-text (Qwen2's and Llama 3 Instruct's are not) and a chat template, conversational pairs whose chosen
answers start with "yes" and rejected ones with "no", `objective.kind=reward` on 2 ranks to its exit, `bigtrain
export`, then scored with plain transformers as docs/preference.md shows: one conversation at a time
(`apply_chat_template`), in a batch padded on the right with the tokenizer's pad (longer than training's rows), and
in a batch padded on the left. Each must rank the held-out pairs as the run's own evaluation did, the scores within
1e-4 of the rows the run evaluated. Two directories: one whose config.json names the tokenizer's pad (as most chat
fine-tunes do), one that names none (bigtrain chooses it). The docs' scoring example runs as printed on the export.
"""
from __future__ import annotations

import ast
import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import torch

from launch import launch_jobs, summary
from local_chat import make_chat_tokenizer, preference_pairs, write_jsonl

SEQ = 48
ARGS = ["--set", "precision=fp32", "--set", "logging.progress_bar=false", "--set", "train.sample_tokens=0",
        "--peak-tflops", "1", "--steps", "10", "--set", "train.eval_interval=0", "--set", "train.eval_batches=2",
        "--set", "batch.micro_batch=4", "--set", "batch.global_batch=8", "--set", f"data.seq_len={SEQ}",
        "--set", "data.val_fraction=0.1", "--set", "optimizer.lr=3e-3", "--set", "schedule.kind=constant",
        "--set", "schedule.warmup_steps=1", "--set", "objective.kind=reward"]
BASES = ("pad_in_config", "no_pad_in_config")


def make_bases(root: Path) -> dict[str, Path]:
    """The same tiny Llama twice, its tokenizer's pad <|endoftext|> and its end-of-text <|eot_id|>: config.json
    naming that pad, and naming none."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dirs = {}
    for name in BASES:
        tok = make_chat_tokenizer(root / name, own_pad=True)
        assert tok.pad_token_id != tok.eos_token_id
        torch.manual_seed(12)
        config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                             tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id if name == "pad_in_config" else None)
        LlamaForCausalLM(config).save_pretrained(root / name)
        dirs[name] = root / name
    return dirs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("reward")
    bases = make_bases(root / "bases")
    data = write_jsonl(root / "pairs.jsonl", preference_pairs(160))  # 16 held out: 2 batches of 4 on each rank
    launch_jobs(root, [{"name": name, "args": ["--model", "hf", "--set", f"model.pretrained={base}",
                                               "--data", str(data), *ARGS]} for name, base in bases.items()],
                num_ranks=2, name="reward")
    return root


@pytest.fixture(scope="module")
def exports(runs) -> dict[str, Path]:
    """`bigtrain export RUN --out DIR` of each run."""
    from bigtrain.export.__main__ import main
    out = {}
    for name in BASES:
        out[name] = runs / "exported" / name
        stderr = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
            assert main([str(runs / name), "--out", str(out[name])]) == 0, stderr.getvalue()[-3000:]
    return out


def evaluated_rows(run: Path, base: Path) -> tuple[torch.Tensor, list[list[int]]]:
    """The held-out pairs' rows as the run's evaluation read them ([2n, SEQ]: the n chosen, then the n rejected),
    and each row's own tokens (its conversation, without the padding)."""
    from bigtrain.data import build_data
    from bigtrain.data.pairs import flat_pairs
    bundle = build_data(str(run.parent / "pairs.jsonl"), "text", seq_len=SEQ, tokenizer=str(base),
                        cache_dir=run / "data_cache", tokenizer_dir=run / "t", val_fraction=0.1)
    val = bundle.val
    rows = flat_pairs(val.take(list(range(len(val)))))["input_ids"]
    lengths = val.examples.lengths[val.pairs.T.reshape(-1)]  # the same order: chosen, then rejected
    return rows, [row[:int(n)].tolist() for row, n in zip(rows, lengths)]


def conversations_by_tokens(tok) -> dict[tuple[int, ...], str]:
    """Every pair's two conversations as the user renders them (`apply_chat_template`), by their tokens."""
    texts = {}
    for record in preference_pairs(160):
        for side in ("chosen", "rejected"):
            text = tok.apply_chat_template(record["prompt"] + record[side], tokenize=False)
            texts[tuple(tok(text, add_special_tokens=False)["input_ids"])] = text
    return texts


@torch.no_grad()
def user_scores(model, tok, texts: list[str], how: str) -> torch.Tensor:
    """Rewards as a user computes them: one conversation at a time, or a batch padded on the right (to twice the
    training length) or on the left, with the tokenizer's pad and its attention mask."""
    if how == "one at a time":
        return torch.stack([model(**tok(t, add_special_tokens=False, return_tensors="pt")).logits[0, 0]
                            for t in texts])
    tok.padding_side = "right" if how == "right-padded batch" else "left"
    padding = {"padding": "max_length", "max_length": 2 * SEQ} if how == "right-padded batch" else {"padding": True}
    batch = tok(texts, add_special_tokens=False, return_tensors="pt", **padding)
    assert (batch["input_ids"] == tok.pad_token_id).any()
    return model(**batch).logits[:, 0]


def ranked(scores: torch.Tensor) -> torch.Tensor:
    n = len(scores) // 2
    return scores[:n] > scores[n:]


@pytest.mark.parametrize("name", BASES)
def test_the_exported_reward_model_scores_conversations_as_its_run_did(runs, exports, name):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    run, base = runs / name, runs / "bases" / name
    tok = AutoTokenizer.from_pretrained(exports[name])
    model = AutoModelForSequenceClassification.from_pretrained(exports[name]).eval()
    config = json.loads((exports[name] / "config.json").read_text())
    rows, conversations = evaluated_rows(run, base)
    padded_with = {int(row[-1]) for row in rows}
    print(f"{name}: config.json pad_token_id {config.get('pad_token_id')}, tokenizer pad {tok.pad_token_id} / eos "
          f"{tok.eos_token_id}, the run's rows padded with {sorted(padded_with)}")
    # the run's own evaluation: its rows through the export give its held-out metrics
    with torch.no_grad():
        evaluated = model(rows).logits[:, 0]
    n = len(evaluated) // 2
    ran = {k: v[-1][1] for k, v in summary(run)["val_metrics"].items()}
    accuracy = float(ranked(evaluated).float().mean())
    margin = float((evaluated[:n] - evaluated[n:]).mean())
    # the user's: the same conversations rendered by apply_chat_template, scored through transformers
    texts_by_tokens = conversations_by_tokens(tok)
    assert all(tuple(c) in texts_by_tokens for c in conversations), "rows that apply_chat_template does not render"
    texts = [texts_by_tokens[tuple(c)] for c in conversations]
    results = {how: user_scores(model, tok, texts, how)
               for how in ("one at a time", "right-padded batch", "left-padded batch")}
    for how, scores in results.items():
        print(f"  {how}: {int(ranked(scores).sum())}/{n} pairs ranked right (the run's rows: "
              f"{int(ranked(evaluated).sum())}/{n}, its evaluation said accuracy {ran.get('accuracy')}), largest "
              f"score difference to the run's rows {float((scores - evaluated).abs().max()):.2e}")
    assert accuracy >= 0.9, "the run learned too little for its ranking to mean anything"
    assert accuracy == pytest.approx(ran["accuracy"], abs=1e-9) and summary(run)["final_val_accuracy"] == ran["accuracy"]
    assert margin == pytest.approx(ran["margin"], abs=1e-4)
    assert float(evaluated.mean()) == pytest.approx(ran["mean_reward"], abs=1e-4)
    assert config["pad_token_id"] == tok.pad_token_id and padded_with == {tok.pad_token_id}
    for how, scores in results.items():
        assert torch.equal(ranked(scores), ranked(evaluated)), how
        assert float((scores - evaluated).abs().max()) < 1e-4, how


def test_the_docs_scoring_example_runs_as_printed(exports):
    """docs/preference.md's example, its directory the export: the preferred answer scores higher, alone as in the
    padded batch."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "preference.md").read_text()
    (example,) = [block for block in re.findall(r"```python\n(.*?)```", page, re.S) if "exported/rm" in block]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(example.replace('"exported/rm"', repr(str(exports["pad_in_config"]))), {})
    batch, alone = out.getvalue().strip().splitlines()
    rewards = ast.literal_eval(batch)
    print(f"the docs' example: rewards {rewards} in a padded batch, the second alone {alone}")
    assert len(rewards) == 2 and rewards[0] > rewards[1]
    assert float(alone) == pytest.approx(rewards[1], abs=1e-4)
