"""Run by tests/dist/test_hf_models_training.py on its ranks (tests/launch.py: launch_jobs): runner jobs one after another in
one launch (start-up dominates on 2 cores), as equiv_runs.py, plus what the Hugging Face tests need.

Usage: hf_runs.py ROOT PLAN.json
PLAN.json is a list of equiv_runs.py jobs ({"name", "args", "expect_error"}) with, optionally,
- "resume_from": NAME  copy ROOT/NAME first (rank 0), drop its newest checkpoint, and resume from
  the one before it (the run's args carry --resume): the resumed curve must continue the first;
- "logits": true  after training, the trained engine's logits on a fixed batch of token ids
  (every rank runs the forward: ZeRO-3 gathers the shards), saved by rank 0 to ROOT/NAME/logits.pt
  as {"input_ids", "logits"}.
"""
from __future__ import annotations

import json
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import deepspeed
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

from equiv_runs import run_one  # noqa: E402

from bigtrain.distributed.world import World, barrier, init_distributed, shutdown  # noqa: E402
from bigtrain.train.process import setup_logging  # noqa: E402

LOGIT_IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))


@contextmanager
def engine_kept(box: dict) -> Iterator[None]:
    """Keep the engine `deepspeed.initialize` builds, to run it after the job."""
    initialize = deepspeed.initialize

    def keeping(*args: Any, **kwargs: Any) -> Any:
        result = initialize(*args, **kwargs)
        box["engine"] = result[0]
        return result

    deepspeed.initialize = keeping
    try:
        yield
    finally:
        deepspeed.initialize = initialize


def copy_without_newest(root: Path, source: str, name: str, world: World) -> None:
    if world.is_main:
        shutil.copytree(root / source, root / name)
        (root / name / "summary.json").unlink(missing_ok=True)
        tags = sorted(p for p in (root / name / "checkpoints").iterdir() if p.name.startswith("step_"))
        shutil.rmtree(tags[-1])
    barrier()


@torch.no_grad()
def save_logits(engine: Any, out: Path, world: World) -> None:
    engine.eval()
    logits = engine(LOGIT_IDS.to(engine.device)).logits.float().cpu()
    if world.is_main:
        torch.save({"input_ids": LOGIT_IDS, "logits": logits}, out / "logits.pt")


def main() -> None:
    root, plan = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    root = Path(root)
    world = init_distributed()
    setup_logging(world)
    for job in json.loads(Path(plan).read_text()):
        if job.get("resume_from"):
            copy_without_newest(root, job["resume_from"], job["name"], world)
        box: dict = {}
        with engine_kept(box):
            run_one(root, job, world)
        if job.get("logits"):
            save_logits(box["engine"], root / job["name"], world)
        box.clear()
        barrier()
    shutdown()


if __name__ == "__main__":
    main()
