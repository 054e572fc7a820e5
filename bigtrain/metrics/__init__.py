"""Training metrics: FLOPs / MFU against a measured peak, step timing, per-rank memory,
the rank-0 progress bar and log line, monitors (TensorBoard / CSV / W&B / Comet via DeepSpeed),
the loss plot, and where log lines go.

`flops`    measure_peak_tflops, achieved_tflops, mfu, ThroughputMeter
`memory`   memory_report (model-state bytes from the tensors), peak_memory
`progress` format_log_line, ProgressBar
`monitor`  MetricsLogger
`plot`     loss.png of a run, `bigtrain plot` overlaying runs
`logs`     bigtrain's lines on the console, DeepSpeed's and warnings in the rank's log file

Names are imported on first use: `flops` and `memory` import DeepSpeed, which the CLI's light
verbs (help, plot) must not pay for.
"""
from __future__ import annotations

from bigtrain.lazy import lazy_names

_WHERE = {
    "ThroughputMeter": "flops", "achieved_tflops": "flops", "as_dtype": "flops", "measure_peak_tflops": "flops",
    "mfu": "flops", "memory_per_rank_bytes": "memory", "memory_report": "memory", "peak_memory": "memory",
    "peak_rss_bytes": "memory", "reset_peak_memory": "memory", "rss_bytes": "memory", "MetricsLogger": "monitor",
    "ProgressBar": "progress", "format_bytes": "progress", "format_duration": "progress",
    "format_log_line": "progress", "human_count": "progress",
}
__all__ = sorted(_WHERE)
__getattr__ = lazy_names(__name__, _WHERE)
