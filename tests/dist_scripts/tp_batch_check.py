"""A job of tests/dist/test_parallel_modes.py's 2-rank launch (equiv_runs.py's {"call": "tp_batch_check.check"}): a
tensor-parallel engine (llama tiny, parallel.tensor=2) fed a different batch on each rank of its group must stop with
one line (a ValueError), on every rank. Writes OUT/rank{R}.txt with the message (or "trained" when no error came)."""
from __future__ import annotations

from pathlib import Path

import torch

from bigtrain import models
from bigtrain.config.load import load_run_config
from bigtrain.distributed.world import World
from bigtrain.ds.resolve import resolve
from bigtrain.train.engine import Engine, EngineOptions


def check(out: Path, world: World) -> None:
    run = load_run_config(None, ["model.family=llama", "parallel.tensor=2", "precision=fp32", "data.seq_len=16"])
    config = resolve(run, None, world.size).ds_config
    spec = models.build("llama", "tiny", vocab_size=64, seq_len=16)
    engine = Engine(spec, config, EngineOptions(compile=False, loss_impl="plain"))
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(world.rank))  # rank-dependent
    try:
        engine.train_step(iter([{"input_ids": tokens[:, :-1], "labels": tokens}]))
        outcome = "trained"
    except ValueError as err:
        outcome = str(err)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{world.rank}.txt").write_text(outcome)
