"""data.padding (bigtrain/data/loader.py `trim_padding`): each micro-batch of examples or pairs cut after the last
column any row trains on, as TRL's collators pad to the batch's longest row. The cut changes no loss or answer
log-probability of a causal model (each column reads only the ones before it), leaves other batches as they are,
and is refused where the rows must have one length."""
from __future__ import annotations

import pytest
import torch

from bigtrain.data.loader import trim_padding
from bigtrain.models.losses import answer_logps, causal_lm_loss

IGNORE, PAD, WIDTH = -100, 0, 24


def rows(lengths: list[int], vocab: int = 64) -> dict:
    """Rows as bigtrain.data.examples lays them out: tokens, then padding; each row's first label ignored."""
    g = torch.Generator().manual_seed(0)
    ids = torch.full((len(lengths), WIDTH), PAD)
    labels = torch.full((len(lengths), WIDTH), IGNORE)
    for r, n in enumerate(lengths):
        ids[r, :n] = torch.randint(1, vocab, (n,), generator=g)
        labels[r, 1:n] = ids[r, 1:n]
    return {"input_ids": ids, "labels": labels}


def test_a_batch_is_cut_after_its_last_trained_column_and_its_losses_do_not_change():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    batch = rows([5, 11, 7])
    batch["labels"][1, 9:11] = IGNORE  # the longest row's last tokens untrained: the cut is after column 8
    cut = trim_padding(batch)
    assert cut["input_ids"].shape == cut["labels"].shape == (3, 9)
    assert torch.equal(cut["input_ids"], batch["input_ids"][:, :9])
    with torch.no_grad():
        full, short = model(batch["input_ids"]).logits, model(cut["input_ids"]).logits
    assert torch.allclose(causal_lm_loss(full, batch["labels"]), causal_lm_loss(short, cut["labels"]), atol=1e-6)
    for a, b in zip(answer_logps(full, batch["labels"]), answer_logps(short, cut["labels"])):
        assert torch.allclose(a.float(), b.float(), atol=1e-5)


def test_pairs_are_cut_on_their_last_dimension_only_and_other_batches_pass_as_they_are():
    flat = rows([4, 9, 6, 3])
    pairs = {k: v.view(2, 2, WIDTH) for k, v in flat.items()}
    pairs["reference_logps"] = torch.zeros(2, 2)
    cut = trim_padding(pairs)
    assert cut["input_ids"].shape == (2, 2, 9) and cut["reference_logps"].shape == (2, 2)
    untrained = {"input_ids": torch.ones(2, WIDTH, dtype=torch.long), "labels": torch.full((2, WIDTH), IGNORE)}
    assert trim_padding(untrained)["labels"].shape == (2, 1)
    block = {"input_ids": torch.ones(2, WIDTH, dtype=torch.long), "labels": torch.ones(2, WIDTH + 1, dtype=torch.long)}
    prompts = {"prompt_ids": torch.ones(2, 5, dtype=torch.long), "prompt_mask": torch.ones(2, 5, dtype=torch.long)}
    full = rows([WIDTH, 3])
    for same in (block, prompts, full):
        assert trim_padding(same) is same


@pytest.mark.parametrize("sets, longest", [([], True), (["data.padding=max_length"], False),
                                           (["pipeline.stages=2"], False), (["parallel.sequence=2"], False)])
def test_auto_pads_to_the_longest_row_but_where_rows_need_one_length(sets, longest):
    from bigtrain.config.load import load_run_config
    from bigtrain.train.inputs import pads_to_longest
    assert pads_to_longest(load_run_config(None, ["model.family=llama", "model.size=tiny", *sets])) is longest
    with pytest.raises(ValueError, match="data.padding=longest with pipeline.stages=2 .* set data.padding to auto"):
        load_run_config(None, ["model.family=llama", "pipeline.stages=2", "data.padding=longest"])


def test_a_steps_pairs_are_regrouped_by_length_so_a_batch_of_short_pairs_is_cut_short():
    """bigtrain.data.loader.by_length: a step's pairs (here 2 batches of 2) sorted by their last trained column and
    cut again into as many batches, each then trimmed to its own longest; every pair, its reference log-probabilities
    beside it, trains in the same step; a batch that is not all tensors of rows passes as it is."""
    from bigtrain.data.loader import by_length
    lengths = [[9, 20], [4, 6], [18, 5], [7, 3]]  # chosen, rejected of 4 pairs: widths 20, 6, 18, 7
    flat = rows([n for pair in lengths for n in pair])
    pairs = {k: v.view(4, 2, WIDTH) for k, v in flat.items()}
    pairs["reference_logps"] = torch.arange(8.0).view(4, 2)
    stream = iter([{k: v[:2] for k, v in pairs.items()}, {k: v[2:] for k, v in pairs.items()}])
    before = [trim_padding(b)["labels"].shape[-1] for b in ({k: v[:2] for k, v in pairs.items()},
                                                            {k: v[2:] for k, v in pairs.items()})]
    after = [trim_padding(b) for b in by_length(stream, 2)]
    assert before == [20, 18] and [b["labels"].shape[-1] for b in after] == [7, 20]
    assert [b["reference_logps"][:, 0].tolist() for b in after] == [[2.0, 6.0], [4.0, 0.0]]  # pairs 1, 3 | 2, 0
    for batch, order in zip(after, ([1, 3], [2, 0])):
        width = batch["input_ids"].shape[-1]
        assert torch.equal(batch["input_ids"], pairs["input_ids"][order][..., :width])
        assert torch.equal(batch["labels"], pairs["labels"][order][..., :width])
    images = [{"input_ids": torch.ones(2, 3), "labels": torch.ones(2, 3), "pixels": object()} for _ in range(2)]
    assert list(by_length(iter(images), 2)) == images


@pytest.mark.parametrize("kind, grouped", [("dpo", True), ("ipo", True), ("simpo", True), ("orpo", False),
                                           ("lm", False)])
def test_only_objectives_whose_step_loss_ignores_the_split_regroup_it(kind, grouped):
    """DPO, IPO and SimPO average a loss per pair over equal micro-batches: their steps' pairs are grouped by
    length; ORPO's NLL is a token mean over each micro-batch's chosen answers, and other objectives keep the order."""
    from bigtrain.config.load import load_run_config
    from bigtrain.objectives import build_objective
    run = load_run_config(None, ["model.family=llama", "model.size=tiny", f"objective.kind={kind}"])
    assert build_objective(run.objective).step_batches(4) == (4 if grouped else 1)
