"""The log line and the rank-0 progress bar (one updating line on a terminal, plain lines in CI)."""
from __future__ import annotations

import math
import sys
import time
from typing import TextIO


def human_count(x: float) -> str:
    """12345 -> '12.3k'; 1.2e6 -> '1.20M'."""
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= limit:
            value = x / limit
            return f"{value:.2f}{suffix}" if value < 10 else f"{value:.1f}{suffix}"
    return f"{x:.1f}"


def format_bytes(n: float) -> str:
    """Bytes in decimal units, as GPU data sheets state memory: 2.1e9 -> '2.1 GB'."""
    for limit, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= limit:
            return f"{n / limit:.1f} {unit}"
    return f"{n:.0f} B"


def format_duration(seconds: float) -> str:
    """3725 -> '1:02:05'; 65 -> '1:05'."""
    if not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def format_log_line(step: int, total: int, loss: float | None = None, lr: float | None = None,
                    tokens_per_s: float | None = None, samples_per_s: float | None = None,
                    tflops: float | None = None, mfu: float | None = None,
                    mem_bytes: float | None = None) -> str:
    """`step 20/200 | loss 3.412 | lr 3.0e-04 | 12.3k tok/s | 1.85 TFLOP/s | MFU 31.2% | mem 2.1 GB/rank`.

    Fields left as None are omitted; tokens/s is shown instead of samples/s when both are given.
    `tflops` is the job's achieved rate; `mfu` a fraction in [0, 1].
    """
    parts = [f"step {step}/{total}"]
    if loss is not None:
        parts.append(f"loss {loss:.3f}")
    if lr is not None:
        parts.append(f"lr {lr:.1e}")
    if tokens_per_s is not None:
        parts.append(f"{human_count(tokens_per_s)} tok/s")
    elif samples_per_s is not None:
        parts.append(f"{human_count(samples_per_s)} samples/s")
    if tflops is not None:
        parts.append(f"{tflops:.3g} TFLOP/s")
    if mfu is not None:
        parts.append(f"MFU {100 * mfu:.1f}%")
    if mem_bytes is not None:
        parts.append(f"mem {format_bytes(mem_bytes)}/rank")
    return " | ".join(parts)


class ProgressBar:
    """Rank 0's progress: `[####......] 20/200 | loss 3.412 | ... | ETA 4:10`.

    On a terminal one line is redrawn in place (at most every `min_interval` s); when the
    stream is not a TTY (CI, a log file) a plain line is written every `log_every` steps
    and at the last step. Disabled (enabled=False) it writes nothing: pass
    `enabled=rank == 0`.
    """

    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool = True,
                 log_every: int = 10, min_interval: float = 0.1, width: int = 20) -> None:
        assert total > 0 and log_every > 0
        self.total, self.enabled, self.log_every = total, enabled, log_every
        self.min_interval, self.width = min_interval, width
        self.stream = stream or sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._start_time: float | None = None
        self._start_step = 0
        self._last_draw = 0.0
        self._open_line = False

    def eta_s(self, step: int) -> float:
        """Seconds left, from the average step time since the first update."""
        if self._start_time is None or step <= self._start_step:
            return float("inf")
        per_step = (time.perf_counter() - self._start_time) / (step - self._start_step)
        return per_step * (self.total - step)

    def update(self, step: int, **fields: float | None) -> None:
        """Show `step` with `fields` (the keywords of `format_log_line`)."""
        if not self.enabled:
            return
        if self._start_time is None:  # time from the first update: start-up is not a step
            self._start_time, self._start_step = time.perf_counter(), step
        line = f"{format_log_line(step, self.total, **fields)} | ETA {format_duration(self.eta_s(step))}"
        last = step >= self.total
        if self.tty:
            now = time.perf_counter()
            if now - self._last_draw < self.min_interval and not last:
                return
            self._last_draw = now
            filled = int(self.width * min(step, self.total) / self.total)
            self.stream.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {line}\x1b[K")
            self._open_line = True
            if last:
                self.close()
        elif step % self.log_every == 0 or last:
            self.stream.write(line + "\n")
        self.stream.flush()

    def write(self, message: str) -> None:
        """A log message that does not garble the bar: it goes on its own line."""
        if not self.enabled:
            return
        if self._open_line:
            self.stream.write("\n")
            self._open_line = False
        self.stream.write(message + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._open_line:
            self.stream.write("\n")
            self.stream.flush()
        self._open_line = False
