"""The loop: steps, eval, checkpoint cadence, resume and signals. Knows nothing of the model family."""
from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from bigtrain.checkpoint import store as checkpoint
from bigtrain.checkpoint.state import CheckpointState
from bigtrain.distributed.world import World, reduce_step
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
    stop_after: int | None = None  # stop (and save) after this step: for tests and time-boxed jobs


class StopFlag:
    """Set by SIGTERM / SIGINT; the loop saves and exits at the next step boundary on every rank."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""
        if threading.current_thread() is not threading.main_thread():
            return  # a Ray Train/Tune worker runs the job in a thread, where Python cannot take signals
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name


@dataclass
class LoopResult:
    last_step: int
    losses: list[float]  # one per step run in this process, starting at the resumed step
    val_losses: list[tuple[int, float]]
    stopped_by: str  # "", "SIGTERM", "SIGINT", "stop_after"


def train_loop(engine: Engine, world: World, settings: LoopSettings, train_batches: Iterator[dict],
               eval_batches: Callable[[int], list[dict]], start_step: int,
               checkpoint_state: Callable[[int], CheckpointState], reporter: Any) -> LoopResult:
    """Run steps start_step+1 .. settings.steps. `checkpoint_state(step)` gives what resume needs."""
    stop = StopFlag()
    result = LoopResult(start_step, [], [], "")
    step = start_step
    # The step clock runs from one step's end to the next, like a hand-written loop's: everything
    # the loop does between steps (stop flag, logging) counts; eval and checkpoints restart it.
    reporter.clock_restart()
    while step < settings.steps:
        loss, stop_now = reduce_step(engine.train_step(train_batches), stop.requested)
        step += 1
        reporter.on_step(step, loss, engine.lr())
        result.losses.append(loss)
        last = step == settings.steps
        eval_due = (settings.eval_interval and step % settings.eval_interval == 0) or last
        evaluated = eval_due and settings.eval_batches > 0
        if evaluated:
            _evaluate(engine, eval_batches, settings.eval_batches, step, reporter, result)
        if settings.stop_after is not None and step >= settings.stop_after and not last:
            stop_now, stop.signal_name = True, stop.signal_name or "stop_after"
        periodic = settings.ckpt_interval and step % settings.ckpt_interval == 0
        if periodic or last or stop_now:
            path = checkpoint.save(engine.ds, settings.ckpt_dir, step, checkpoint_state(step), world.rank,
                                   settings.keep_last)
            if world.is_main:
                log.info("saved checkpoint %s", path)
            notify("checkpoint", step, {"path": str(path)})
        if stop_now:
            result.stopped_by = stop.signal_name or "signal on another rank"
            if world.is_main:
                log.warning("stopped at step %d (%s); resume with --resume", step, result.stopped_by)
            break
        if evaluated or periodic:
            reporter.clock_restart()
    result.last_step = step
    return result


def _evaluate(engine: Engine, eval_batches: Callable[[int], list[dict]], num_batches: int, step: int,
              reporter: Any, result: LoopResult) -> None:
    if num_batches <= 0:
        return
    val = engine.eval_loss(eval_batches(num_batches))
    result.val_losses.append((step, val))
    reporter.on_eval(step, val)
