"""A step on chat and instruction data is the mean over all its trained tokens : two
sequences with answers of different lengths train alike as one micro-batch of 2 or as 2 accumulated micro-batches
of 1, on a real one-rank engine; per-micro-batch means (what plain text keeps) would weigh them differently.
Across ranks the same rule is proven by tests/dist/test_chat_training.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bigtrain.config.load import load_run_config
from bigtrain.models import build
from bigtrain.models.losses import lm_targets

SEQ, VOCAB = 32, 256


def rows() -> dict[str, torch.Tensor]:
    """Two sequences: one with a 3-token answer, one with a 20-token answer (the rest -100, as chat data has)."""
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    labels = torch.full_like(ids, -100)
    labels[0, 10:13] = ids[0, 10:13]
    labels[1, 5:25] = ids[1, 5:25]
    return {"input_ids": ids, "labels": labels}


def engine_for(micro: int, token_weighted: bool):
    from bigtrain.ds.resolve import resolve
    from bigtrain.train.engine import Engine, EngineOptions
    run = load_run_config(None, ["model.family=llama", "model.size=tiny", "precision=fp32", "zero.stage=1",
                                 f"batch.micro_batch={micro}", "batch.global_batch=2", "optimizer.lr=0.01",
                                 "schedule.kind=constant", "optimizer.torch_adam=true"])
    spec = build("llama", "tiny", vocab_size=VOCAB, seq_len=SEQ)
    return spec, Engine(spec, resolve(run, None, 1).ds_config, EngineOptions(seed=1, token_weighted=token_weighted))


def losses(engine, micro: int, steps: int = 3) -> list[float]:
    both = rows()
    parts = [both] if micro == 2 else [{k: v[i:i + 1] for k, v in both.items()} for i in range(2)]
    batches = iter(parts * steps)
    return [float(engine.train_step(batches)) for _ in range(steps)]


@torch.no_grad()
def token_mean(spec, batch: dict[str, torch.Tensor]) -> float:
    """The mean next-token loss over both rows' trained tokens, from the initial weights."""
    logits = spec.build(seed=1)(input_ids=batch["input_ids"]).logits
    targets = lm_targets(batch["labels"], SEQ)
    return float(F.cross_entropy(logits.flatten(0, -2), targets.reshape(-1), ignore_index=-100))


def test_accumulated_micro_batches_weigh_every_trained_token_alike(one_rank_group):
    spec, whole = engine_for(2, token_weighted=True)
    together = losses(whole, 2)
    _, split = engine_for(1, token_weighted=True)
    accumulated = losses(split, 1)
    assert together[0] == pytest.approx(token_mean(spec, rows()), rel=1e-5)
    assert accumulated == pytest.approx(together, rel=1e-5)  # steps 2-3: the updates were the same too


def test_without_token_weighting_the_grouping_changes_the_loss(one_rank_group):
    """What plain text keeps (every row trains the same number of tokens there): each micro-batch's mean counts
    alike, so the 3-token answer weighs as much as the 20-token one; the test above would see it."""
    _, split = engine_for(1, token_weighted=False)
    spec, whole = engine_for(2, token_weighted=False)
    first = losses(split, 1, steps=1)[0]
    assert losses(whole, 2, steps=1)[0] == pytest.approx(token_mean(spec, rows()), rel=1e-5)
    assert abs(first - token_mean(spec, rows())) > 1e-3
