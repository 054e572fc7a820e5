"""Sample tables: rows an objective shows of a step (online RL: each prompt, its completion, its rewards and
advantage), written at log steps to OUT/samples.jsonl (one JSON object a row, with its step) and to the trackers
that take tables (`bigtrain.metrics.monitor.MetricsLogger.log_table`: TensorBoard's text, a W&B table, a Comet
table). Rank 0 writes.

A resumed run continues the file: rows of steps after the checkpoint it resumed from (written before a stop,
trained again now) are dropped first, as the CSV monitor's rows are.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FILE = "samples.jsonl"


class SampleLog:
    """OUT/samples.jsonl and the monitor's tables (`monitor`: a MetricsLogger; None writes the file only)."""

    def __init__(self, out: str | Path, monitor: Any = None, resumed_at: int | None = None):
        self.path = Path(out) / FILE
        self.monitor = monitor
        if resumed_at is not None and self.path.is_file():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resumed_at]
            self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, step: int, rows: list[dict]) -> None:
        if not rows:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}, ensure_ascii=False, default=str) + "\n")
        if self.monitor is not None:
            self.monitor.log_table(step, "samples", rows)
