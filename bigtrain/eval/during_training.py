"""`train.eval_tasks`: lm-eval tasks at every evaluation of a run, on the engine's own module.

The tasks are checked (names, local folders, their data) when the job starts, before the model is built, so a
typo costs seconds, not a run. At each evaluation every rank wraps the engine's module (the weights as they are,
fp32 or the run's 16-bit; a LoRA run's adapters active) in a `RankSplitLM`:
  - ZeRO 0-2: every rank holds the whole module; the forward passes are split over the ranks, exactly as
    `bigtrain eval --num-gpus N` splits them.
  - ZeRO-3: each rank holds a slice of every weight, gathered layer by layer inside each forward pass, so every
    rank takes part in every pass (the same requests on all ranks, in lockstep): the model is never whole on any
    rank, as in training.
Pipeline stages, tensor and sequence parallelism split the forward pass itself in ways lm-eval's requests do not
fit: refused at start with a line (evaluate the checkpoints with `bigtrain eval`). lm-eval seeds Python's, NumPy's
and torch's generators; the run's are put back afterwards, so a run with tasks trains as one without.
"""
from __future__ import annotations

import contextlib
import logging
import random
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

log = logging.getLogger("bigtrain")
INCLUDE = "train.eval_include_path"  # where a run's local task folder is given, for the lines that name it


@dataclass
class TaskEvaluator:
    """The run's tasks, loaded once; `run(engine)` scores the engine's module on them."""

    tasks: Any  # bigtrain.eval.tasks.TaskSet
    tokenizer: Any
    limit: float | None
    rank: int
    world: int
    batch_size: int = 8

    @classmethod
    def start(cls, run: Any, spec: Any, tokenizer: Any, rank: int, world: int) -> TaskEvaluator | None:
        """None without `run.train.eval_tasks`; ValueError (one line) for a model, layout, task or data that cannot
        work. `spec`: the run's model (a `ModelSpec`), `tokenizer`: the run's."""
        train = run.train
        if not train.eval_tasks:
            return None
        if spec.hf_class is None or spec.modality != "text" or tokenizer is None:
            raise ValueError(f"train.eval_tasks with a {spec.family} {spec.modality} model: lm-eval scores causal "
                             "language models with a tokenizer (gpt2, llama, hf); drop train.eval_tasks")
        check_layout(run)
        from bigtrain.eval.tasks import load_tasks, split_names, task_manager
        names = split_names(train.eval_tasks)
        tasks = load_tasks(names, task_manager(train.eval_include_path, names, INCLUDE), include_flag=INCLUDE)
        if rank == 0:
            log.info("eval tasks: %s at every evaluation%s", ", ".join(names),
                     f" (at most {train.eval_limit:g} documents each)" if train.eval_limit else "")
        return cls(tasks, tokenizer, train.eval_limit, rank, world)

    def run(self, engine: Any) -> dict[str, dict[str, float]]:
        """{task: {metric: value}} for the module as it is now, the same on every rank."""
        from bigtrain.eval.lm import RankSplitLM
        from bigtrain.eval.runner import evaluate, scores
        module = engine.module()
        zero3 = engine.ds.zero_optimization_stage() == 3
        with kept_rng(), torch.no_grad():
            lm = RankSplitLM(module, self.tokenizer, self.batch_size, rank=self.rank, world=self.world,
                             split=not zero3, progress=False)
            results = evaluate(lm, self.tasks, limit=self.limit, bootstrap_iters=0, progress=False)
        found = [scores(results) if results is not None and self.rank == 0 else None]
        if self.world > 1:
            torch.distributed.broadcast_object_list(found, src=0)  # the ranks' listeners hear the same numbers
        return found[0] or {}


def check_tasks(run: Any) -> None:
    """ValueError (one line) for train.eval_tasks on a layout lm-eval cannot follow, a task folder that is not there or
    a name no task file defines: what can be known before any rank starts (no model, no task data)."""
    if not run.train.eval_tasks:
        return
    check_layout(run)
    from bigtrain.eval.tasks import check_task_names, split_names
    check_task_names(split_names(run.train.eval_tasks), run.train.eval_include_path, INCLUDE)


def check_layout(run: Any) -> None:
    """ValueError (one line) when the run splits the forward pass in a way lm-eval's requests cannot follow."""
    split = [f"{key}={value}" for key, value in (("pipeline.stages", run.pipeline.stages),
                                                  ("parallel.tensor", run.parallel.tensor),
                                                  ("parallel.sequence", run.parallel.sequence)) if value > 1]
    if split:
        raise ValueError(f"train.eval_tasks with {', '.join(split)}: the tasks run on whole or ZeRO-3 modules only; "
                         "drop train.eval_tasks and evaluate the checkpoints with `bigtrain eval RUN --tasks ...`")


@contextlib.contextmanager
def kept_rng() -> Iterator[None]:
    """Python's, NumPy's and torch's (CPU and accelerator) generators as they were before the block."""
    py, npy = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        yield
    random.setstate(py)
    np.random.set_state(npy)
