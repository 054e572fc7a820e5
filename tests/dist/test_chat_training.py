"""Training on chat data: a chat jsonl prepared with `bigtrain prepare`, then trained from the prepared
directory, packed and unpacked, on one process and packed on 2 ranks (sequence parallelism; ZeRO-3 data parallel),
with the loss on the answers, a held-out evaluation, the padding reported and the end-of-run sample answering a
held-out prompt through the chat template. Per-step losses on 2 ranks equal one process's within 1e-5 (fp32).

A step's loss is the mean over all its answer tokens, however its sequences are grouped: 4 sequences per step as
one micro-batch of 4, as 4 accumulated micro-batches of 1, or as 2 ranks x 2 train alike, although their answers
differ in length (a mean of micro-batch means would weigh a short answer's tokens more)."""
from __future__ import annotations

import pytest

from launch import launch_jobs, summary
from local_chat import conversations, make_chat_tokenizer, write_jsonl

RTOL = 1e-5
STEPS = 4


def args(data, *extra: str) -> list[str]:
    return ["--model", "llama", "--size", "tiny", "--data", str(data), "--steps", str(STEPS),
            "--set", "data.seq_len=64", "--set", "precision=fp32", "--set", "logging.progress_bar=false",
            "--set", "train.eval_interval=2", "--set", "train.eval_batches=100", "--set", "batch.global_batch=4",
            "--peak-tflops", "1", *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from bigtrain.data.prepare.cli import main

    root = tmp_path_factory.mktemp("chat_training")
    make_chat_tokenizer(root / "tok")
    source = write_jsonl(root / "chat.jsonl", conversations(160, max_words=5))
    assert main(["--data", str(source), "--tokenizer", str(root / "tok"), "--out", str(root / "prepared"),
                 "--num-proc", "1", "--quiet"]) == 0
    data = root / "prepared"
    packed, no_sample = ["--set", "data.packing=true"], ["--set", "train.sample_tokens=0"]
    one = launch_jobs(root, [
        {"name": "ref_packed", "args": args(data, *packed, "--set", "train.sample_tokens=12", "--set",
                                            "batch.micro_batch=4")},
        {"name": "ref_packed_m1", "args": args(data, *packed, *no_sample, "--set", "batch.micro_batch=1")},
        {"name": "ref_unpacked", "args": args(data, *no_sample, "--set", "batch.micro_batch=1")}], num_ranks=1,
        name="one")
    two = launch_jobs(root, [
        {"name": "sp2_packed", "args": args(data, *packed, *no_sample, "--set", "batch.micro_batch=4",
                                            "--set", "parallel.sequence=2")},
        {"name": "dp2_packed_z3", "args": args(data, *packed, "--set", "zero.stage=3", "--set", "batch.micro_batch=2",
                                                 "--set", "train.sample_tokens=12")}], num_ranks=2, name="two")
    return root, one, two


def worst(reference: list[float], losses: list[float]) -> float:
    assert len(reference) == len(losses) == STEPS
    return max(abs(a - b) / abs(a) for a, b in zip(reference, losses))


@pytest.mark.parametrize("name, reference", [("sp2_packed", "ref_packed"), ("dp2_packed_z3", "ref_packed"),
                                             ("ref_packed_m1", "ref_packed")])
def test_chat_data_trains_alike_however_a_step_is_grouped(runs, name, reference):
    root, _, _ = runs
    ran, ref = summary(root / name), summary(root / reference)
    margin = worst(ref["losses"], ran["losses"])
    print(f"{name} vs {reference}: worst relative loss difference {margin:.2e}")
    assert margin <= RTOL, (ref["losses"], ran["losses"])
    val, ref_val = ran["val_losses"][-1][1], ref["val_losses"][-1][1]  # every held-out example, answers only
    assert len(ran["val_losses"]) == 2 and abs(val - ref_val) <= RTOL * ref_val


def test_packing_reports_the_padding_it_saves_and_the_sample_answers_a_held_out_prompt(runs):
    root, one, two = runs
    packed, unpacked = summary(root / "ref_packed")["data"], summary(root / "ref_unpacked")["data"]
    assert packed["format"] == "chat" and packed["train_examples"] == unpacked["train_examples"]
    assert packed["pad_share"] < unpacked["pad_share"] and packed["pad_share_unpacked"] == unpacked["pad_share"]
    assert packed["real_tokens_per_s"] > 0
    print(f"padding {unpacked['pad_share']:.1%} unpacked -> {packed['pad_share']:.1%} packed "
          f"({unpacked['train_rows']} -> {packed['train_rows']} rows)")
    assert "padding" in one and "packed" in one  # the data line of the log
    for log in (one, two):  # one process, and ZeRO-3 (every rank generates in lockstep)
        sample = log.split("the trained model answers a held-out prompt ---")[1].split("-----")[0]
        # the prompt (rendered by the template) ends with the assistant's header: what follows it was generated
        prompt, generated = sample.rsplit("<|start_header_id|>assistant<|end_header_id|>", 1)
        assert "<|start_header_id|>user<|end_header_id|>" in prompt
        assert generated.strip(), f"no token generated after the prompt: {sample!r}"
