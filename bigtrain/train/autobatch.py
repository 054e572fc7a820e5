"""`batch.micro_batch: auto`: the largest micro-batch that fits in device memory, found by a short probe,
with the global batch kept by gradient accumulation.

The search (`search_micro_batch`) doubles the micro-batch until a probe fails (out of memory, or a peak
above the budget), then bisects between the last that fitted and the first that did not; it is pure
and tested with a fake memory limit. The probe (`probe_micro_batch`) runs real training steps on a
throw-away engine built like the job's (same model, ZeRO stage, precision, loss path): DeepSpeed
allocates its optimizer states on the first step, so the peak of a full step is what training needs.
The job's engine is then built fresh from the same seed, so probing changes neither the initial
weights nor the data order.

Memory comes from `get_accelerator()`: the peak allocated bytes of the step against the device's
total (GPUs). The CPU accelerator reports the process's RSS when asked, not a true peak within the
step, so on a CPU host the probe is a rough guide (and the budget is split between the host's ranks).
"""
from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

log = logging.getLogger("bigtrain")
BUDGET_FRACTION = 0.9  # of device memory: room for fragmentation, evaluation and the allocator's slack


@dataclass
class Search:
    """The outcome of a search: the largest size that fitted (0: none) and every probe in order."""

    best: int = 0
    probes: list[tuple[int, bool]] = field(default_factory=list)

    def describe(self) -> str:
        return ", ".join(f"{n} {'fits' if ok else 'does not'}" for n, ok in self.probes)


def search_micro_batch(fits: Callable[[int], bool], upper: int, start: int = 1) -> Search:
    """Largest n in [1, upper] with `fits(n)`, for a `fits` that holds up to some size and fails above it.
    Doubles from `start` (capped at `upper`) until a failure, then bisects; every size is probed once."""
    if upper < 1:
        raise ValueError(f"micro-batch search: upper bound {upper} must be >= 1")
    result = Search()
    seen: dict[int, bool] = {}

    def probe(n: int) -> bool:
        if n not in seen:
            seen[n] = fits(n)
            result.probes.append((n, seen[n]))
        return seen[n]

    n = max(1, min(start, upper))
    while probe(n):
        result.best = n
        if n == upper:
            return result
        n = min(2 * n, upper)
    low, high = result.best, n  # low fits (0: not even `start`), high does not
    while high - low > 1:
        mid = (low + high) // 2
        if probe(mid):
            low = mid
        else:
            high = mid
    result.best = low
    return result


def is_out_of_memory(err: BaseException) -> bool:
    """torch.OutOfMemoryError (CUDA, XPU, ...) or an allocator's "out of memory" RuntimeError."""
    return type(err).__name__ == "OutOfMemoryError" or "out of memory" in str(err).lower()


def probe_budget_bytes(device_name: str, ranks_on_host: int) -> int:
    """What one rank may use: a share of the device (GPUs), or of the host's memory split between its ranks."""
    from deepspeed.accelerator import get_accelerator
    total = get_accelerator().total_memory()
    return int(BUDGET_FRACTION * total / (ranks_on_host if device_name == "cpu" else 1))


class _Prober:
    """`fits(n)` for the search: `steps` real training steps at micro-batch n, agreed by every rank.

    A size the last fitting probe predicts to be over budget (activations grow linearly with the
    micro-batch) is answered without running it, so that ranks seldom meet a real out-of-memory error
    (one rank failing inside a collective would leave the others waiting)."""

    def __init__(self, make_engine: Callable[[], Any], batches_of: Callable[[int], Iterator[dict]],
                 budget_bytes: int, steps: int):
        from deepspeed.accelerator import get_accelerator
        self.acc, self.make_engine, self.batches_of = get_accelerator(), make_engine, batches_of
        self.budget, self.steps = budget_bytes, steps
        self.engine: Any = None
        self.per_sample: tuple[int, float] | None = None  # (bytes held between steps, peak bytes per sample)

    def predicted(self, n: int) -> float | None:
        return None if self.per_sample is None else self.per_sample[0] + n * self.per_sample[1]

    def fits(self, n: int) -> bool:
        guess = self.predicted(n)
        ok = (guess is None or guess <= self.budget) and self._run(n)
        from bigtrain.distributed.world import all_ranks_agree
        return all_ranks_agree(ok)

    def _run(self, n: int) -> bool:
        self.engine = self.engine or self.make_engine()
        batches = self.batches_of(n)
        try:
            self.acc.reset_peak_memory_stats()
            for _ in range(self.steps):
                float(self.engine.train_step(batches))  # the host sync ends the step before the peak is read
            peak, held = self.acc.max_memory_allocated(), self.acc.memory_allocated()
        except Exception as err:  # noqa: BLE001 -- only an out-of-memory error is an answer
            if not is_out_of_memory(err):
                raise
            self.close()  # an engine that ran out of memory mid-step is not reused
            return False
        self.per_sample = (held, max(peak - held, 0) / n)
        return peak <= self.budget

    def close(self) -> None:
        deepspeed_engine = getattr(self.engine, "ds", None)
        self.engine = None
        if deepspeed_engine is None:
            _free(self.acc)
            return
        from bigtrain.ds.release import release_engine
        release_engine(deepspeed_engine)  # collects and empties the cache itself


def probe_micro_batch(make_engine: Callable[[], Any], batches_of: Callable[[int], Iterator[dict]], per_rank: int,
                      budget_bytes: int, steps: int = 2) -> Search:
    """Search the micro-batch (at most `per_rank`, the rank's share of the global batch) with `steps` real
    training steps per size on an engine from `make_engine()` (rebuilt after an out-of-memory error)."""
    prober = _Prober(make_engine, batches_of, budget_bytes, steps)
    try:
        return search_micro_batch(prober.fits, per_rank)
    finally:
        prober.close()


def _free(acc: Any) -> None:
    gc.collect()
    acc.empty_cache()


def choose_micro_batch(spec: Any, probe_config: dict, global_batch: int, options: Any, data: Any,
                       world: Any) -> tuple[int, str]:
    """The probed micro-batch (a divisor of the rank's share of `global_batch`, so accumulation keeps it) and a
    line for the log. `probe_config`: the throw-away engines' DeepSpeed dict (one sample per rank, from
    `bigtrain.ds.resolve`); the job's own dict is resolved again with the size chosen."""
    import os
    from dataclasses import replace

    from deepspeed.accelerator import get_accelerator

    from bigtrain.ds.batch import largest_divisor_upto
    from bigtrain.train.engine import Engine
    dp = world.size  # micro_batch=auto runs without pipeline stages: every rank is data-parallel
    per_rank = global_batch // dp
    data.set_data_parallel(world.rank, dp)
    device_name = get_accelerator().device_name()
    ranks_on_host = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    # Probed eager: compiling each size would take longer than the probe, and compiled steps need less memory.
    search = probe_micro_batch(lambda: Engine(spec, probe_config, replace(options, compile=False)),
                               data.train_batches, per_rank, probe_budget_bytes(device_name, ranks_on_host))
    if search.best == 0:
        raise ValueError(f"batch.micro_batch=auto: not even 1 sample per rank fits in {device_name} memory "
                         f"({search.describe()}); use zero.stage=3, offload or activation_checkpointing, or a shorter "
                         "data.seq_len")
    micro = largest_divisor_upto(per_rank, search.best)
    return micro, (f"batch.micro_batch=auto: probed {search.describe()}; micro-batch {micro} x accumulation "
                   f"{per_rank // micro} x data-parallel {dp} = train_batch_size {global_batch}")


def defer_auto(run: Any) -> tuple[Any, bool]:
    """`run` with micro_batch=auto left unset (the DeepSpeed config first derives one from the global batch,
    and the probe then replaces it), and whether it was auto."""
    from dataclasses import replace
    if run.batch.micro_batch != "auto":
        return run, False
    return replace(run, batch=replace(run.batch, micro_batch=None)), True
