"""Packing: several examples per row with position ids that restart at each, so that attention never
crosses an example boundary and every example gets the loss it gets alone (fp32, within 1e-5), for Llama (rotary
positions; sdpa and eager attention) and GPT-2 (learned positions); the padding it saves; and the same
document-aware attention under sequence parallelism, where Ulysses drops the model's mask."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from local_chat import conversations, make_chat_tokenizer, write_jsonl

from bigtrain import models
from bigtrain.data import build_data
from bigtrain.data.formats import ExampleOptions
from bigtrain.data.examples import pack
from bigtrain.models.losses import lm_targets
from bigtrain.models.spec import call_module, output_logits

SEQ = 96


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    root = tmp_path_factory.mktemp("packing")
    make_chat_tokenizer(root / "tok")
    source = write_jsonl(root / "chat.jsonl", conversations(80, max_words=6))
    common = dict(seq_len=SEQ, tokenizer=str(root / "tok"), cache_dir=root / "cache", tokenizer_dir=root / "t",
                  num_proc=1, val_fraction=0.1)
    return {packing: build_data(str(source), **common, examples=ExampleOptions(packing=packing))
            for packing in (False, True)}


def test_packing_fills_rows_with_every_example_once_and_reports_the_padding_saved(bundles):
    lengths = np.random.default_rng(0).integers(1, 60, size=500)
    rows = pack(lengths, 64)
    assert sorted(e for row in rows for e in row) == list(range(500))
    assert all(sum(lengths[row]) <= 64 for row in rows)
    assert len(rows) <= int(np.ceil(lengths.sum() / 64 * 1.1))  # best-fit decreasing: within 10% of the bound
    unpacked, packed = bundles[False].stats, bundles[True].stats
    assert unpacked["train_examples"] == packed["train_examples"] and packed["train_rows"] < unpacked["train_rows"]
    assert packed["pad_share_unpacked"] == unpacked["pad_share"] and packed["pad_share"] < unpacked["pad_share"] / 2
    assert "padding" in bundles[True].description and "packed" in bundles[True].description
    print(f"padding: {unpacked['pad_share']:.1%} of the tokens unpacked ({unpacked['train_rows']} rows), "
          f"{packed['pad_share']:.1%} packed ({packed['train_rows']} rows)")


def example_losses(spec, model, batch) -> list[float]:
    """Mean next-token loss of each example of each row (examples found where the position ids restart)."""
    inputs, labels = spec.batch_to_inputs(batch)
    logits = output_logits(call_module(model, inputs))
    targets = lm_targets(labels, logits.shape[-2])
    per_token = F.cross_entropy(logits.float().flatten(0, 1), targets.reshape(-1), ignore_index=-100,
                                reduction="none").view_as(targets)
    positions = batch.get("position_ids", torch.arange(targets.shape[1]).expand_as(targets))
    losses = []
    for row in range(targets.shape[0]):
        example = (positions[row] == 0).cumsum(0)
        for e in example.unique():
            trained = (example == e) & (targets[row] != -100)
            if trained.any():
                losses.append(float(per_token[row][trained].mean()))
    return losses


@pytest.mark.parametrize("family, overrides", [
    ("llama", {}), ("llama", {"attn_implementation": "eager"}), ("gpt2", {}),
    ("gpt2", {"attn_implementation": "eager"})])
def test_a_packed_batch_gives_each_example_the_loss_it_gets_alone(bundles, family, overrides):
    packed_rows, alone = bundles[True].train, bundles[False].train
    spec = models.build(family, "tiny", vocab_size=bundles[True].vocab_size, seq_len=SEQ, **overrides)
    model = spec.build(seed=0).float().eval()
    rows = [i for i in range(len(packed_rows)) if len(packed_rows.row_examples(i)) >= 2][:4]
    assert len(rows) == 4
    batch = packed_rows.take(rows)
    assert "position_ids" in batch and batch["input_ids"].shape == (4, SEQ)
    with torch.no_grad():
        packed = example_losses(spec, model, batch)
        # each example alone: its own unpacked row (the unpacked rows hold the same training examples, in order)
        index = {int(e): i for i, e in enumerate(alone.members)}
        singles = [example_losses(spec, model, alone.take([index[int(e)]]))[0]
                   for r in rows for e in packed_rows.row_examples(r)]
        crossing = example_losses(spec, model, {k: v for k, v in batch.items() if k != "position_ids"})
    worst = max(abs(a - b) for a, b in zip(packed, singles))
    print(f"{family} {overrides or 'sdpa'}: {len(packed)} packed examples, worst |loss packed - alone| {worst:.2e}")
    assert len(packed) == len(singles) and worst <= 1e-5
    # without the restarting positions the examples see each other: the check above would fail
    assert max(abs(a - b) for a, b in zip(crossing, singles)) > 1e-3


def test_sequence_parallel_attention_keeps_packed_examples_apart():
    """Ulysses hands its core attention the gathered position ids and no mask: `document_sdpa` must give what
    sdpa gives each example alone, and plain causal sdpa where nothing is packed."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from bigtrain.parallel.sequence import document_sdpa

    module = torch.nn.Module()
    module.is_causal = True
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 12, 8, generator=g) for _ in range(3))
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3], list(range(12))])
    out, _ = document_sdpa(sdpa_attention_forward)(module, q, k, v, None, position_ids=positions)
    for row, bounds in ((0, [(0, 5), (5, 8), (8, 12)]), (1, [(0, 12)])):
        for a, b in bounds:
            alone, _ = sdpa_attention_forward(module, q[row:row + 1, :, a:b], k[row:row + 1, :, a:b],
                                              v[row:row + 1, :, a:b], None)
            assert torch.allclose(out[row, a:b], alone[0], atol=1e-6)


def test_sequence_parallel_shard_takes_the_batchs_positions():
    from bigtrain.parallel.split import ModelSplit, Topology

    class Group:  # the sequence-parallel coordinates of rank 1 of 2
        @staticmethod
        def get_sequence_parallel_rank() -> int:
            return 1

    split = ModelSplit(Topology(world=2, sequence=2), rank=1, mpu=Group())
    ids, labels = torch.arange(8).view(1, 8), torch.arange(8).view(1, 8)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0]])
    inputs, targets = split.shard({"input_ids": ids, "position_ids": positions}, labels)
    assert inputs["position_ids"].tolist() == [[1, 2, 3, 0]] and inputs["input_ids"].tolist() == [[4, 5, 6, 7]]
    assert targets.tolist() == [[5, 6, 7, -100]]
    plain, _ = split.shard(ids, labels)  # no positions given: the global ones
    assert plain["position_ids"].tolist() == [[4, 5, 6, 7]]
