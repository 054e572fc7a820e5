""""call" jobs of tests/dist/test_vlm_training.py's launches (tests/dist_scripts/equiv_runs.py runs them on every rank).

`run_logits(OUT, world)`: the logits the trained model gives on prompts with images, computed by the training code
itself: the engine rebuilt as the job built it (its spec, DeepSpeed dict and LoRA adapters, ZeRO-3 partitioned over
the launch's ranks), the run's last checkpoint loaded, the forward on the model's fixed inputs (two prompts with an
image each, through its processor: `ModelSpec.fixed_inputs`). Rank 0 writes OUT/logits.pt, for the test to hold
the export (read back by transformers' own classes) to.
"""
from __future__ import annotations

from pathlib import Path

import torch

from bigtrain import models
from bigtrain.atomic import replacing
from bigtrain.checkpoint import store as checkpoint
from bigtrain.checkpoint.state import read_state
from bigtrain.config.run_config import LoraConfig
from bigtrain.distributed.world import World
from bigtrain.train.engine import Engine, EngineOptions
from bigtrain.train.policy import to_device

RUN = "lora_z3"  # the job whose checkpoint is read


def run_logits(out: Path, world: World) -> None:
    ckpt = out.parent / RUN / "checkpoints"
    tag_dir = max(p for p in ckpt.iterdir() if p.name.startswith("step_"))
    state = read_state(tag_dir)
    mb = state.model_build
    spec = models.build(mb.family, mb.size, **mb.overrides)
    monitors = ("csv_monitor", "tensorboard", "wandb", "comet")
    ds_config = {k: v for k, v in state.ds_config.items() if k not in monitors}
    run = state.run_config
    engine = Engine(spec, ds_config, EngineOptions(seed=run["train"]["seed"], lora=LoraConfig(**run["lora"])))
    checkpoint.load(engine.ds, tag_dir.parent, tag_dir.name)
    engine.ds.eval()
    with torch.no_grad():
        logits = engine.ds(**to_device(spec.fixed_inputs(), engine.device)).logits.float().cpu()
    if world.is_main:
        out.mkdir(parents=True, exist_ok=True)
        with replacing(out / "logits.pt") as f:
            torch.save({"logits": logits, "checkpoint": str(tag_dir)}, f)
