"""Run by tests/dist/test_parallel_modes.py on 2 ranks: a tensor-parallel engine (llama tiny, parallel.tensor=2)
fed a different batch on each rank of its group must stop with one line (a ValueError), on every rank.
Writes ROOT/rank{R}.txt with the message (or "trained" when no error came)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bigtrain import models  # noqa: E402
from bigtrain.config.load import load_run_config  # noqa: E402
from bigtrain.distributed.world import init_distributed, shutdown  # noqa: E402
from bigtrain.ds.resolve import resolve  # noqa: E402
from bigtrain.train.engine import Engine, EngineOptions  # noqa: E402


def main() -> None:
    root = Path(sys.argv[1])
    world = init_distributed()
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
    (root / f"rank{world.rank}.txt").write_text(outcome)
    shutdown()


if __name__ == "__main__":
    main()
