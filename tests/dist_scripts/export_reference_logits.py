"""The trained model's own logits, for the export tests (launch with the real launcher, 2 ranks).

    deepspeed --num_gpus 2 tests/dist_scripts/export_reference_logits.py TAG_DIR OUT.pt [TAG_DIR OUT.pt ...]

Rebuilds the engine exactly as bigtrain/job.py does (spec from bigtrain.json's model_build,
its ds_config, EngineOptions from its run_config), loads the checkpoint with
`bigtrain.checkpoint.store.load`, and computes logits on a fixed input: the engine forward on
every rank (ZeRO-3 gathers the shards), or `eval_batch(return_logits=True)` through the
pipeline (the last stage holds them). Saves {"input_ids", "logits", "fresh_logits" (before
the load), "pipeline"} to OUT.pt. Several checkpoints in one launch save the start-up time.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from bigtrain import models  # noqa: E402
from bigtrain.atomic import replacing  # noqa: E402
from bigtrain.checkpoint import store as checkpoint  # noqa: E402
from bigtrain.checkpoint.state import CheckpointState, read_state  # noqa: E402
from bigtrain.distributed.world import init_distributed, shutdown  # noqa: E402
from bigtrain.train.engine import Engine, EngineOptions  # noqa: E402

MONITORS = ("csv_monitor", "tensorboard", "wandb", "comet")  # keep the run's own logs untouched


def fixed_input(vocab_size: int, batch: int, seq_len: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(123))


def build_engine(state: CheckpointState) -> Engine:
    mb = state.model_build
    spec = models.build(mb.family, mb.size, **mb.overrides)
    run = state.run_config
    ds_config = {k: v for k, v in state.ds_config.items() if k not in MONITORS}
    return Engine(spec, ds_config, EngineOptions(
        pipeline_stages=state.pipeline_stages, partition_method=run["pipeline"]["partition_method"],
        activation_checkpointing=run["activation_checkpointing"]["enabled"],
        checkpoint_every_n_layers=run["activation_checkpointing"]["every_n_layers"], seed=run["train"]["seed"]))


@torch.no_grad()
def logits_of(engine: Engine, ids: torch.Tensor) -> torch.Tensor | None:
    """This rank's logits, or None on a pipeline stage that is not the last."""
    ids = ids.to(engine.device)
    if engine.is_pipeline:
        _, logits = engine.ds.eval_batch(iter([(ids, ids)]), return_logits=True, num_micro_batches=1)
        return logits.float().cpu() if engine.ds.is_last_stage() else None
    engine.ds.eval()
    return engine.ds(ids).logits.float().cpu()


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher adds --local_rank=N
    assert args and len(args) % 2 == 0, "usage: TAG_DIR OUT.pt [TAG_DIR OUT.pt ...]"
    world = init_distributed()
    for tag_dir, out in zip(args[::2], args[1::2]):
        reference(Path(tag_dir), Path(out), world.rank)
    shutdown()


def reference(tag_dir: Path, out: Path, rank: int) -> None:
    """Logits of the model in `tag_dir` before and after loading it, saved by the rank that has them."""
    state = read_state(tag_dir)
    engine = build_engine(state)
    ids = fixed_input(engine.spec.config.vocab_size, engine.micro_batch, engine.spec.seq_len)
    fresh = logits_of(engine, ids)  # before loading: shows the load (and so the comparison) is not vacuous
    checkpoint.load(engine.ds, tag_dir.parent, tag_dir.name)
    logits = logits_of(engine, ids)
    # Non-pipeline ranks all hold the same logits; rank 0 writes. With a pipeline, the last stage does.
    writer = (engine.ds.is_last_stage() and engine.dp_rank == 0) if engine.is_pipeline else rank == 0
    if writer:
        assert logits is not None
        with replacing(out) as f:
            torch.save({"input_ids": ids, "logits": logits, "fresh_logits": fresh, "pipeline": engine.is_pipeline}, f)


if __name__ == "__main__":
    main()
