"""MetricsLogger: scalars to TensorBoard / CSV / W&B / Comet through DeepSpeed's MonitorMaster, kept in memory.

DeepSpeed's engine already writes its own `Train/Samples/*` events when the config has a
`tensorboard`, `csv_monitor`, `wandb` or `comet` section; bigtrain's metrics go under their own
prefix, so the files never collide. Pass the engine's monitor (`engine.monitor`) to share its
writers, or the DeepSpeed config dict to build one.

Experiment trackers are DeepSpeed's own monitors: `logging.wandb` / `logging.comet` become the
`wandb` / `comet` sections (`tracker_sections`), the packages are optional extras
(`pip install 'bigtrain[wandb]'`, `'bigtrain[comet]'`), and the run config is attached to the
tracker's run once the engine has started it. Without credentials a tracker writes offline under
OUT/ (`wandb sync` / comet's offline upload later), so a run never waits on the network.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from bigtrain.atomic import write_atomic

PREFIX = "bigtrain/"
TRACKERS = {"wandb": "wandb", "comet": "comet_ml"}  # run-config switch -> the package DeepSpeed's monitor imports
log = logging.getLogger("bigtrain")


def tracker_sections(logging_config: Any, out_dir: str | Path, run_name: str | None = None) -> dict:
    """The DeepSpeed `wandb` / `comet` sections for `logging.wandb` / `logging.comet`. ValueError in one line
    when the package of a tracker (or of logging.tensorboard) is missing. Sets the trackers' directories
    (and offline mode without credentials) in this process's environment, where DeepSpeed's monitors read them."""
    sections: dict = {}
    wanted = [name for name in TRACKERS if getattr(logging_config, name, False)]
    for name in wanted + (["tensorboard"] if getattr(logging_config, "tensorboard", False) else []):
        package = TRACKERS.get(name, name)
        if importlib.util.find_spec(package) is None:
            raise ValueError(f"logging.{name}=true needs the {package} package: pip install 'bigtrain[{name}]' "
                             f"(or set logging.{name}=false)")
    project = getattr(logging_config, "project", None) or "bigtrain"
    out = Path(out_dir)
    if "wandb" in wanted:
        os.environ.setdefault("WANDB_DIR", str(out))
        if not os.environ.get("WANDB_API_KEY") and not _netrc_has("api.wandb.ai"):
            os.environ.setdefault("WANDB_MODE", "offline")
        sections["wandb"] = {"enabled": True, "project": project, "group": run_name}
    if "comet" in wanted:
        os.environ.setdefault("COMET_OFFLINE_DIRECTORY", str(out / "comet"))
        online = bool(os.environ.get("COMET_API_KEY")) and os.environ.get("COMET_MODE", "").lower() != "offline"
        sections["comet"] = {"enabled": True, "project": project, "experiment_name": run_name, "online": online}
    return sections


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


def _netrc_has(host: str) -> bool:
    import netrc
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def attach_run_config(monitor: Any, run_config: dict) -> list[str]:
    """Record `run_config` on the trackers DeepSpeed's monitor started (rank 0); returns their names."""
    attached = []
    if getattr(monitor, "wandb_monitor", None) is not None and getattr(monitor.wandb_monitor, "enabled", False):
        import wandb
        if wandb.run is not None:
            wandb.run.config.update(run_config, allow_val_change=True)
            attached.append("wandb")
    comet = getattr(monitor, "comet_monitor", None)
    experiment = getattr(comet, "experiment", None) if comet is not None else None
    if experiment is not None:
        experiment.log_parameters(_flat(run_config))
        attached.append("comet")
    return attached


def _flat(tree: dict, prefix: str = "") -> dict:
    out: dict = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


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

    def __init__(self, ds_config: dict | None = None, monitor: Any = None, prefix: str = PREFIX,
                 run_config: dict | None = None) -> None:
        self.monitor = monitor if monitor is not None else (_monitor_from_config(ds_config) if ds_config else None)
        self.prefix = prefix
        self.history: list[dict[str, float]] = []
        if run_config is not None and self.monitor is not None:
            attach_run_config(self.monitor, run_config)

    @property
    def writing(self) -> bool:
        return self.monitor is not None and bool(getattr(self.monitor, "enabled", True))

    def log(self, step: int, metrics: dict[str, float | None]) -> None:
        """Record the finite numbers of `metrics` at `step` (None and nan are left out)."""
        values = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        self.history.append({"step": step, **values})
        if self.writing and values:
            self.monitor.write_events([(f"{self.prefix}{k}", v, step) for k, v in values.items()])

    def log_table(self, step: int, name: str, rows: list[dict]) -> list[str]:
        """`rows` (dicts with the same keys) as a table at `step`, on the trackers that take tables: TensorBoard
        (a markdown table as text), W&B (`wandb.Table`), Comet (`log_table`). Returns the ones written to."""
        if not self.writing or not rows:
            return []
        columns = list(dict.fromkeys(k for row in rows for k in row))
        cells = [[_cell(row.get(c)) for c in columns] for row in rows]
        written = []
        tensorboard = getattr(getattr(self.monitor, "tb_monitor", None), "summary_writer", None)
        if tensorboard is not None:
            lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            lines += ["| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in row) + " |"
                      for row in cells]
            tensorboard.add_text(f"{self.prefix}{name}", "\n".join(lines), step)
            tensorboard.flush()
            written.append("tensorboard")
        wandb_monitor = getattr(self.monitor, "wandb_monitor", None)
        if wandb_monitor is not None and getattr(wandb_monitor, "enabled", False):
            import wandb
            wandb_monitor.log({f"{self.prefix}{name}": wandb.Table(columns=columns, data=cells)}, step=step)
            written.append("wandb")
        experiment = getattr(getattr(self.monitor, "comet_monitor", None), "experiment", None)
        if experiment is not None:
            experiment.log_table(f"{name}_step{step}.csv", tabular_data=cells, headers=columns)
            written.append("comet")
        return written

    def continue_from(self, step: int, samples: int) -> None:
        """A resumed run's CSV files: rows after the checkpoint (run before a stop, run again now) are dropped, and
        DeepSpeed's CSV monitor, which heads every file it first writes in a process, is told the files have their
        header. bigtrain's files count steps (kept up to `step`), DeepSpeed's own count samples (kept up to
        `samples`). TensorBoard and wandb keep their own step order."""
        import csv

        writer = getattr(self.monitor, "csv_monitor", None)
        log_dir = getattr(writer, "log_dir", None)  # rank 0's only
        if writer is None or not log_dir or not Path(log_dir).is_dir():
            return
        ours = self.prefix.replace("/", "_")
        for path in sorted(Path(log_dir).glob("*.csv")):
            rows = list(csv.reader(path.read_text().splitlines()))
            if not rows:
                continue
            last = step if path.name.startswith(ours) else samples
            kept = [rows[0]] + [r for r in rows[1:] if r and r[0] != "step" and int(float(r[0])) <= last]
            with path.open("w", newline="") as f:
                csv.writer(f).writerows(kept)
            writer.filenames.append(path.stem)

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
        return write_atomic(path, json.dumps({"summary": self.summary(), "history": self.history, **(extra or {})},
                                             indent=2))
