"""The log line and the rank-0 progress bar: a tqdm bar on a terminal, plain lines in CI and log files.

While the bar is open, bigtrain's log lines (and `ProgressBar.write`) are printed through
`tqdm.write`, which lifts the bar, prints the line and redraws the bar below it, so a line never
lands on the bar's line.
"""
from __future__ import annotations

import logging
import math
import sys
import time
from typing import Any, TextIO


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
                    grad_norm: float | None = None, tokens_per_s: float | None = None, samples_per_s: float | None = None,
                    tflops: float | None = None, mfu: float | None = None,
                    mem_bytes: float | None = None) -> str:
    """`step 20/200 | loss 3.412 | lr 3.0e-04 | grad norm 0.82 | 12.3k tok/s | 1.85 TFLOP/s | MFU 31.2% | mem 2.1 GB/rank`.

    Fields left as None are omitted; tokens/s is shown instead of samples/s when both are given.
    `grad_norm`: the step's gradient norm before clipping; `tflops` the job's achieved rate; `mfu` a fraction in
    [0, 1].
    """
    parts = [f"step {step}/{total}"]
    if loss is not None:
        parts.append(f"loss {loss:.3f}")
    if lr is not None:
        parts.append(f"lr {lr:.1e}")
    if grad_norm is not None:
        parts.append(f"grad norm {grad_norm:.3g}")
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
    """Rank 0's progress.

    On a terminal: a tqdm bar advanced every step (`tick`), its postfix the latest log line's
    fields (`update`, at log steps): `42%|####      | 84/200 [0:31<0:43, loss 3.412 | lr 3.0e-04 | ...]`.
    Otherwise (CI, a log file, `tty=False`) a plain line every `log_every` steps and at the last
    step: `step 20/200 | loss 3.412 | ... | ETA 4:10`. Disabled (enabled=False) it writes nothing:
    pass `enabled=rank == 0`.
    """

    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool = True,
                 log_every: int = 10, min_interval: float = 0.1) -> None:
        assert total > 0 and log_every > 0
        self.total, self.enabled, self.log_every, self.min_interval = total, enabled, log_every, min_interval
        self.stream = stream or sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._start_time: float | None = None
        self._start_step = 0
        self._bar: Any = None
        self._rerouted: list[tuple[logging.StreamHandler, TextIO]] = []

    def eta_s(self, step: int) -> float:
        """Seconds left, from the average step time since the first update."""
        if self._start_time is None or step <= self._start_step:
            return float("inf")
        per_step = (time.perf_counter() - self._start_time) / (step - self._start_step)
        return per_step * (self.total - step)

    def tick(self, step: int) -> None:
        """Step `step` is done: moves the bar on a terminal (cheap: tqdm redraws at most every
        min_interval). The bar closes at the last step's `update`, or at `close`."""
        if self.enabled and self.tty:
            bar = self._open(step)
            bar.update(step - bar.n)

    def update(self, step: int, **fields: float | None) -> None:
        """Show `step` with `fields` (the keywords of `format_log_line`)."""
        if not self.enabled:
            return
        if self._start_time is None:  # time from the first update: start-up is not a step
            self._start_time, self._start_step = time.perf_counter(), step
        if self.tty:
            bar = self._open(step)
            bar.set_postfix_str(format_log_line(step, self.total, **fields).split(" | ", 1)[-1], refresh=False)
            bar.update(step - bar.n)
            bar.refresh()
            if step >= self.total:
                self.close()
            return
        if step % self.log_every == 0 or step >= self.total:
            line = f"{format_log_line(step, self.total, **fields)} | ETA {format_duration(self.eta_s(step))}"
            self.stream.write(line + "\n")
            self.stream.flush()

    def write(self, message: str) -> None:
        """A log message that does not garble the bar: printed above it."""
        if not self.enabled:
            return
        if self._bar is not None:
            from tqdm import tqdm
            tqdm.write(message, file=self.stream)
        else:
            self.stream.write(message + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Leave the bar's last state on screen and give logging its streams back."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        for handler, stream in self._rerouted:
            handler.setStream(stream)
        self._rerouted = []

    def _open(self, step: int) -> Any:
        if self._bar is None:
            from tqdm import tqdm
            first = max(0, min(step - 1, self.total))  # a resumed run starts at its step, not at 0
            self._bar = tqdm(total=self.total, initial=first, file=self.stream, mininterval=self.min_interval,
                             dynamic_ncols=True, unit="step", leave=True, smoothing=0.1,
                             bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]")
            self._reroute_logging()
        return self._bar

    def _reroute_logging(self) -> None:
        """Console log handlers on a terminal print through tqdm.write while the bar is open."""
        for logger in (logging.getLogger(), logging.getLogger("bigtrain")):
            for handler in logger.handlers:
                stream = getattr(handler, "stream", None)
                if (type(handler) is logging.StreamHandler and stream is not None
                        and getattr(stream, "isatty", lambda: False)()):
                    self._rerouted.append((handler, handler.setStream(_AboveBar(stream))))


class _AboveBar:
    """A stream for logging handlers: each line through `tqdm.write` (above the bar)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        from tqdm import tqdm
        if text.strip():
            tqdm.write(text.rstrip("\n"), file=self.stream)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return True
