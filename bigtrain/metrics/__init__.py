"""Training metrics: FLOPs / MFU against a measured peak, step timing, per-rank memory,
the rank-0 progress bar and log line, and monitors (TensorBoard / CSV via DeepSpeed).

`flops`    measure_peak_tflops, achieved_tflops, mfu, ThroughputMeter
`memory`   memory_report (model-state bytes from the tensors), peak_memory
`progress` format_log_line, ProgressBar
`monitor`  MetricsLogger
"""
from bigtrain.metrics.flops import ThroughputMeter, achieved_tflops, as_dtype, measure_peak_tflops, mfu
from bigtrain.metrics.memory import (memory_per_rank_bytes, memory_report, peak_memory, peak_rss_bytes,
                                     reset_peak_memory, rss_bytes)
from bigtrain.metrics.monitor import MetricsLogger
from bigtrain.metrics.progress import ProgressBar, format_bytes, format_duration, format_log_line, human_count

__all__ = [
    "MetricsLogger", "ProgressBar", "ThroughputMeter", "achieved_tflops", "as_dtype", "format_bytes",
    "format_duration", "format_log_line", "human_count", "measure_peak_tflops", "memory_per_rank_bytes",
    "memory_report", "mfu", "peak_memory", "peak_rss_bytes", "reset_peak_memory", "rss_bytes",
]
