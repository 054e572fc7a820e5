"""The loop: steps, eval, checkpoint cadence, resume and signals. Knows nothing of the model family."""
from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Protocol

from bigtrain.checkpoint import store as checkpoint
from bigtrain.checkpoint.state import CheckpointState
from bigtrain.distributed.lifeline import Lifeline
from bigtrain.distributed.world import World, collective_timeout_s, reduce_step
from bigtrain.train.engine import Engine
from bigtrain.train.report import notify

log = logging.getLogger("bigtrain")


@dataclass(frozen=True)
class LoopSettings:
    steps: int
    eval_interval: int  # 0: only at the end
    eval_batches: int
    ckpt_dir: Path
    ckpt_interval: int  # 0: only at the end / on a signal
    keep_last: int
    save_at_end: bool = True
    stop_after: int | None = None  # stop (and save) after this step: for tests and time-boxed jobs
    max_loss: float | None = None  # train.max_loss: a loss above it stops the run, as a non-finite one does
    resumed_from: Path | None = None  # the checkpoint this job resumed from: the last good one until it saves


class Diverged(Exception):
    """The loss (or the weights) stopped being finite, or the loss passed train.max_loss: the run stops without
    saving, and the job exits with `code`."""

    code = 3


class Batches(Protocol):
    """Where the loop's batches come from (`bigtrain.train.inputs.TrainingData`)."""

    def train_batches(self, micro_batch: int, step_batches: int = 1) -> Iterator[dict]: ...

    def eval_batches(self, micro_batch: int, max_batches: int | None = None) -> Iterable[dict]: ...


class CheckpointRecord(Protocol):
    """What a checkpoint records beside DeepSpeed's files, at a given step (`bigtrain.train.job.RunRecord`)."""

    def state_at(self, step: int, losses: list[float], history: dict | None = None) -> CheckpointState: ...


@dataclass
class LoopResult:
    last_step: int
    losses: list[float]  # one per step run in this process, starting at the resumed step
    val_losses: list[tuple[int, float]]
    stopped_by: str  # "", "SIGTERM", "SIGINT", "the launcher ... is gone", "stop_after", "diverged"
    diverged: str = ""  # what went wrong at which step, when the run diverged
    last_checkpoint: Path | None = None  # the newest complete checkpoint of this run
    set_aside: Path | None = None  # the checkpoint whose weights gave the diverged loss, renamed out of the way


def train_loop(engine: Engine, *, world: World, settings: LoopSettings, data: Batches, record: CheckpointRecord,
               reporter: Any, stop: Lifeline, start_step: int = 0, task_eval: Any = None) -> LoopResult:
    """Run steps start_step+1 .. settings.steps; every checkpoint holds `record.state_at(step, losses, history)`.

    `stop` (the job's lifeline) says when SIGTERM/SIGINT or the launcher's death asks every rank
    to save and stop; the flag travels with each step's loss all-reduce, so all ranks stop at the
    same step. The last save is bounded: a peer that never joins it ends the job with a line.
    A non-finite loss, or one above settings.max_loss, ends the loop without a save (`result.diverged`).
    `task_eval` (`bigtrain.eval.during_training.TaskEvaluator`, train.eval_tasks) scores lm-eval tasks at each
    evaluation."""
    train_batches = data.train_batches(engine.data_batch, engine.step_batches)
    result = LoopResult(start_step, [], [], "", last_checkpoint=settings.resumed_from)
    step = start_step
    saved_at = start_step if settings.resumed_from else -1  # the step of result.last_checkpoint
    # The step clock runs from one step's end to the next, like a hand-written loop's: everything
    # the loop does between steps (stop flag, logging) counts; eval and checkpoints restart it.
    reporter.clock_restart()
    while step < settings.steps:
        step += 1
        loss, stop_now = one_step(engine, train_batches, step, stop, reporter, result)
        if problem := loss_problem(loss, settings.max_loss):
            diverge(result, f"step {step}: {problem}", settings, world, weights_saved=saved_at == step - 1)
            break
        last = step == settings.steps
        evaluated = evaluate_if_due(engine, data, settings, step, last, stop, reporter, result, task_eval)
        stopped_by = ""
        if settings.stop_after is not None and step >= settings.stop_after and not last:
            stop_now, stopped_by = True, stop.reason or "stop_after"
        periodic = settings.ckpt_interval and step % settings.ckpt_interval == 0
        save = periodic or (last and settings.save_at_end) or stop_now
        if (save or last) and not engine.weights_finite():  # never save (or end on) non-finite weights
            result.diverged = f"step {step}: its update left non-finite weights (the loss was {loss:.4g})"
            result.stopped_by = "diverged"
            break
        if save:
            result.last_checkpoint, saved_at = save_checkpoint(engine, settings, record, reporter, world, stop, step,
                                                               bounded=last or stop_now), step
        if stop_now:
            result.stopped_by = stopped_by or stop.reason or "a stop request on another rank"
            if world.is_main:
                log.warning("stopped at step %d (%s); resume with --resume", step, result.stopped_by)
            break
        if evaluated or periodic:
            reporter.clock_restart()
    result.last_step = step
    return result


def one_step(engine: Engine, batches: Iterator[dict], step: int, stop: Lifeline, reporter: Any,
             result: LoopResult) -> tuple[float, bool]:
    """Training step `step`, its loss and metrics averaged over the ranks with the stop flag (one collective);
    returns (the loss, whether any rank was asked to stop)."""
    stop.set_phase(f"training step {step}")
    lr = engine.lr()  # the rate this step's update uses (the scheduler moves on after it)
    loss, stop_now, metrics = reduce_step(engine.train_step(batches), stop.requested, engine.step_metrics)
    reporter.on_step(step, loss, lr, metrics)
    result.losses.append(loss)
    return loss, stop_now


def diverge(result: LoopResult, what: str, settings: LoopSettings, world: World, weights_saved: bool) -> None:
    """The run stops without a save; when the last checkpoint holds the very weights that gave this loss
    (`weights_saved`), it is set aside and the newest complete one before it is the last."""
    result.diverged, result.stopped_by = what, "diverged"
    if weights_saved:
        result.set_aside = checkpoint.set_aside(result.last_checkpoint, world)
        newest = checkpoint.newest_complete(settings.ckpt_dir)
        result.last_checkpoint = settings.ckpt_dir / newest if newest else None


def evaluate_if_due(engine: Engine, data: Batches, settings: LoopSettings, step: int, last: bool, stop: Lifeline,
                    reporter: Any, result: LoopResult, task_eval: Any) -> bool:
    """Evaluate at every eval_interval-th step and the last (held-out batches, lm-eval tasks); whether it did."""
    due = (settings.eval_interval and step % settings.eval_interval == 0) or last
    if not (due and (settings.eval_batches > 0 or task_eval is not None)):
        return False
    stop.set_phase(f"evaluating at step {step}")
    _evaluate(engine, data, settings.eval_batches, step, reporter, result, task_eval)
    return True


def save_checkpoint(engine: Engine, settings: LoopSettings, record: CheckpointRecord, reporter: Any, world: World,
                    stop: Lifeline, step: int, bounded: bool) -> Path:
    """The checkpoint of `step`; `bounded` (the last save, or one on a stop): a peer that never joins it ends the
    job with a line."""
    what = f"saving the checkpoint of step {step}"
    with stop.bound(what, collective_timeout_s() + 60, "every rank to write its part") if bounded \
            else _phase(stop, what):
        state = record.state_at(step, reporter.losses, reporter.history())
        path = checkpoint.save(engine.ds, settings.ckpt_dir, step, state, world, settings.keep_last,
                               rank_state=engine.objective.state_dict())
    if world.is_main:
        log.info("saved checkpoint %s", path)
    notify("checkpoint", step, {"path": str(path)})
    return path


def loss_problem(loss: float, max_loss: float | None) -> str | None:
    """Why this loss stops the run, or None. The loss is the all-reduced one: every rank decides alike."""
    if not math.isfinite(loss):
        return f"the loss is {loss} (not finite)"
    if max_loss is not None and loss > max_loss:
        return f"the loss {loss:.4g} is above train.max_loss={max_loss:g}"
    return None


@contextlib.contextmanager
def _phase(stop: Lifeline, what: str) -> Iterator[None]:
    stop.set_phase(what)
    yield


def _evaluate(engine: Engine, data: Batches, num_batches: int, step: int, reporter: Any, result: LoopResult,
              task_eval: Any = None) -> None:
    val = None
    if num_batches > 0:
        val = engine.eval_loss(list(data.eval_batches(engine.eval_data_batch, num_batches)))
        result.val_losses.append((step, val))
    tasks = task_eval.run(engine) if task_eval is not None else None
    reporter.on_eval(step, val, tasks)
