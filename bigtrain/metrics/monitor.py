"""MetricsLogger: scalars to TensorBoard / CSV through DeepSpeed's MonitorMaster, and kept in memory.

DeepSpeed's engine already writes its own `Train/Samples/*` events when the config has a
`tensorboard` or `csv_monitor` section; bigtrain's metrics go under their own prefix, so
the files never collide. Pass the engine's monitor (`engine.monitor`) to share its writers,
or the DeepSpeed config dict to build one.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

PREFIX = "bigtrain/"


def _monitor_from_config(ds_config: dict) -> Any:
    import deepspeed.comm as dist
    from deepspeed.monitor.config import get_monitor_config
    from deepspeed.monitor.monitor import MonitorMaster

    config = get_monitor_config(ds_config)
    if not config.enabled:
        return None
    if not dist.is_initialized():
        # MonitorMaster asks deepspeed.comm for the rank; without a process group it asserts.
        raise RuntimeError("MetricsLogger with a tensorboard/csv_monitor section needs deepspeed.init_distributed() "
                           "first (the monitors write on rank 0 only)")
    return MonitorMaster(config)


class MetricsLogger:
    """Writes `{name: value}` per step to DeepSpeed's monitors on rank 0 and keeps every rank's history.

    Events are `(f"{prefix}{name}", value, step)`, the tuples DeepSpeed's monitors take; the
    CSV monitor writes one file per name, `<output_path>/<job_name>/bigtrain_<name>.csv`.
    """

    def __init__(self, ds_config: dict | None = None, monitor: Any = None, prefix: str = PREFIX) -> None:
        self.monitor = monitor if monitor is not None else (_monitor_from_config(ds_config) if ds_config else None)
        self.prefix = prefix
        self.history: list[dict[str, float]] = []

    @property
    def writing(self) -> bool:
        return self.monitor is not None and bool(getattr(self.monitor, "enabled", True))

    def log(self, step: int, metrics: dict[str, float | None]) -> None:
        """Record the finite numbers of `metrics` at `step` (None and nan are left out)."""
        values = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        self.history.append({"step": step, **values})
        if self.writing and values:
            self.monitor.write_events([(f"{self.prefix}{k}", v, step) for k, v in values.items()])

    def flush(self) -> None:
        for name in ("tb_monitor",):  # only TensorBoard buffers; the CSV monitor writes on each call
            writer = getattr(self.monitor, name, None)
            if writer is not None and hasattr(writer, "flush"):
                writer.flush()

    def summary(self, last: int = 10) -> dict[str, float]:
        """Each metric's mean over its last `last` records, and the final step."""
        out: dict[str, float] = {}
        if not self.history:
            return out
        names = {k for rec in self.history for k in rec if k != "step"}
        for name in sorted(names):
            values = [rec[name] for rec in self.history if name in rec][-last:]
            out[name] = sum(values) / len(values)
        out["step"] = self.history[-1]["step"]
        return out

    def write_summary(self, path: str | os.PathLike, extra: dict | None = None) -> Path:
        """summary.json: {"summary": ..., "history": [...], **extra}; written atomically."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps({"summary": self.summary(), "history": self.history, **(extra or {})}, indent=2))
        os.replace(tmp, path)
        return path
