"""DeepSpeed's wall-clock breakdown, read back from a job's log.

With `"wall_clock_breakdown": true` rank 0 prints, after every optimizer step, lines like

    time (ms) | fwd: 812.31 | bwd: 1554.20 | bwd_inner: 1502.11 | bwd_allreduce: 51.90 | step: 402.17

(the pipeline engine prints `forward` / `backward` / `step` names at `steps_per_print`). The
timers are host clocks on a CPU and cost nothing there; on a GPU they synchronize once per step.
"""
from __future__ import annotations

import re
import statistics

_LINE = re.compile(r"time \(ms\)((?: \| [A-Za-z_]+: [0-9.]+)+)")
_FIELD = re.compile(r"([A-Za-z_]+): ([0-9.]+)")

# Our names for DeepSpeed's global (per optimizer step) timers, plain engine then pipeline engine.
PHASES = {"forward": ("fwd", "forward"), "backward": ("bwd", "backward"), "step": ("step",),
          "allreduce": ("bwd_allreduce", "backward_allreduce")}


def parse_timer_lines(log: str) -> list[dict[str, float]]:
    """Every `time (ms) | name: value | ...` record in `log`, in order."""
    records = []
    for match in _LINE.finditer(log):
        records.append({name: float(value) for name, value in _FIELD.findall(match.group(1))})
    return records


def step_split(log: str, warmup: int = 2) -> dict[str, float]:
    """Median ms per optimizer step of forward / backward / step (/ allreduce) after `warmup` steps.

    Only the records that carry a global timer count (the micro-step records repeat the same time
    under `*_microstep` names). Phases DeepSpeed did not time are left out.
    """
    split: dict[str, float] = {}
    records = parse_timer_lines(log)
    for phase, names in PHASES.items():
        values = [rec[name] for rec in records for name in names if name in rec]
        values = values[warmup:] if len(values) > warmup else values
        if values:
            split[phase] = statistics.median(values)
    return split
