"""What one more token costs a rank during a training step, measured: a real job (`bigtrain.train.job.train`) whose
step `step` runs under `LiveBytes` (bigtrain.estimate.live_bytes), at two sequence lengths; the difference of the
two peaks, by tensor, over the difference of the lengths.

    from bigtrain.estimate.token_profile import profile_job
    snapshot = profile_job(["--model", "llama", "--set", "data.seq_len=2048", ...], world)

scripts/profile_alst.py runs it at parallel.sequence 1, 2, 4, tiled and not, with and without activation
checkpointing, and writes the table of docs/parallelism.md; the memory model's per-token terms are held to it
(tests/unit/test_token_profile.py).
"""
from __future__ import annotations

import contextlib
import gc
import weakref
from typing import Any, Iterator

from bigtrain.estimate.live_bytes import (Label, LiveBytes, Snapshot, alive_storages, allocator_peak,
                                         resident_bytes)

PROFILED_STEP = 2  # the first step makes the optimizer's states (constant in the sequence length): not counted


@contextlib.contextmanager
def profiled_step(snapshots: list[Snapshot], step: int = PROFILED_STEP, allocator: bool = False) -> Iterator[None]:
    """While inside, the engine's training step number `step` runs under `LiveBytes`; its snapshot is appended to
    `snapshots` (with the CPU allocator's own peak when `allocator`, and the bytes alive before the step that were
    not alive before this context: the job's model states and buffers, not an earlier job's leftovers)."""
    from bigtrain.train.engine import Engine
    plain = Engine.train_step
    count = [0]
    gc.collect()
    earlier = weakref.WeakSet(alive_storages())

    def train_step(self: Any, batches: Iterator[dict]) -> Any:
        count[0] += 1
        if count[0] != step:
            return plain(self, batches)
        gc.collect()
        before = resident_bytes(besides=earlier)
        watch = LiveBytes()

        def work() -> Any:
            with watch:
                loss = plain(self, batches)
                loss = loss.detach().clone()
            return loss

        loss, peak, held = allocator_peak(work) if allocator else (work(), None, {})
        snapshot = watch.snapshot()
        snapshot.allocator_peak, snapshot.allocator_live, snapshot.resident = peak, held, before
        snapshots.append(snapshot)
        return loss

    Engine.train_step = train_step
    try:
        yield
    finally:
        Engine.train_step = plain


def profile_job(args: list[str], world: Any, allocator: bool = False) -> Snapshot:
    """This rank's snapshot of step PROFILED_STEP of the job `bigtrain/run.py ARGS` would run (on `world`'s
    process group, already made)."""
    from bigtrain.config.flags import build_run_parser, run_config_from_args
    from bigtrain.train.job import train
    run = run_config_from_args(build_run_parser().parse_args(args))
    if run.train.steps < PROFILED_STEP:
        raise ValueError(f"a profiled job needs --steps >= {PROFILED_STEP}: step {PROFILED_STEP} is measured")
    snapshots: list[Snapshot] = []
    with profiled_step(snapshots, allocator=allocator):
        train(run, world)
    assert len(snapshots) == 1, f"the job ran {len(snapshots)} profiled steps"
    return snapshots[0]


def row_of(label: Label) -> tuple[str, str, str]:
    """The table's row for a label: (module, tensor, kept): saved for backward, or transient and in which pass."""
    return label.where, label.op, "saved" if label.saved else f"transient ({label.phase})"


def slope(short: Snapshot, long: Snapshot, tokens: int) -> float:
    """Peak bytes per token between two lengths `tokens` apart."""
    return (long.peak - short.peak) / tokens
