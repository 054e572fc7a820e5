"""Where a run's lines go: bigtrain's on the console, the libraries' in the rank's log file.

DeepSpeed logs through its "DeepSpeed" logger, to a stdout handler it adds when it is imported,
and warns at import time (which accelerator it picked), before a run knows its output
directory; torch warns through `warnings` (FutureWarning on every rank). So, before anything
imports DeepSpeed, `route_library_logs` puts a filter on that logger (the same object DeepSpeed
configures later): each record goes to bigtrain's sink instead of DeepSpeed's handler, and
Python warnings go there too. The sink keeps records in memory until `attach_log_file` (once the
run directory is known) and writes everything to `OUT/logs/rank{R}.log` from then on.
`verbose=True` leaves the console as DeepSpeed and torch print it; the file still gets it all.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from collections import deque
from pathlib import Path
from typing import Iterator, TextIO

DEEPSPEED_LOGGER = "DeepSpeed"
FILE_FORMAT = "[%(asctime)s %(levelname)s %(name)s] %(message)s"
CONSOLE_FORMAT = "[%(asctime)s rank{rank}] %(message)s"


class LibrarySink(logging.Handler):
    """Keeps library records (the newest `capacity`) until a file is attached, then writes there."""

    def __init__(self, capacity: int = 10_000) -> None:
        super().__init__(logging.DEBUG)
        self.pending: deque[logging.LogRecord] = deque(maxlen=capacity)
        self.target: logging.Handler | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.target is None:
            self.pending.append(record)
        else:
            self.target.handle(record)

    def attach(self, handler: logging.Handler) -> None:
        self.target = handler
        while self.pending:
            handler.handle(self.pending.popleft())


class _Divert(logging.Filter):
    """On DeepSpeed's logger: every record to the sink, and to `console` from `console_level` up.
    Returning False keeps DeepSpeed's own stdout handler silent (unless verbose)."""

    def __init__(self, sink: LibrarySink, console: logging.Handler | None, console_level: int, verbose: bool):
        super().__init__()
        self.sink, self.console, self.console_level, self.verbose = sink, console, console_level, verbose

    def filter(self, record: logging.LogRecord) -> bool:
        self.sink.handle(record)
        if self.verbose:
            return True
        if self.console is not None and record.levelno >= self.console_level:
            self.console.handle(record)
        return False


_sink: LibrarySink | None = None


def route_library_logs(verbose: bool = False, console: TextIO | None = None,
                       console_level: int = logging.ERROR) -> LibrarySink:
    """Call before DeepSpeed is imported. DeepSpeed's records and Python warnings go to the sink;
    `console` (e.g. sys.stderr) also shows DeepSpeed's records from `console_level` up. Idempotent."""
    global _sink
    if _sink is not None:
        return _sink
    _sink = LibrarySink()
    shown = None
    if console is not None:
        shown = logging.StreamHandler(console)
        shown.setFormatter(logging.Formatter("DeepSpeed %(levelname)s: %(message)s"))
    logging.getLogger(DEEPSPEED_LOGGER).addFilter(_Divert(_sink, shown, console_level, verbose))
    if not verbose:
        logging.captureWarnings(True)
        warned = logging.getLogger("py.warnings")
        warned.propagate = False
        warned.addHandler(_sink)
    return _sink


def quiet_hf_progress_bars() -> None:
    """transformers' own progress bars ("Loading weights", "Writing model shards"), one per rank, stay off the
    console: bigtrain says what it loads and writes. Before transformers is imported it reads the switch from the
    environment; after, its logging module turns them off."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers.utils.logging" in sys.modules:
        sys.modules["transformers.utils.logging"].disable_progress_bar()


def setup_console(rank: int, is_main: bool, stream: TextIO | None = None) -> None:
    """bigtrain's lines on the console: INFO from rank 0, warnings from the others; every rank's
    INFO still reaches its log file (`attach_log_file`)."""
    handler = logging.StreamHandler(stream or sys.stdout)
    handler.setLevel(logging.INFO if is_main else logging.WARNING)
    handler.setFormatter(logging.Formatter(CONSOLE_FORMAT.format(rank=rank), datefmt="%H:%M:%S"))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    logging.getLogger("bigtrain").setLevel(logging.INFO)


def attach_log_file(out_dir: str | Path, rank: int, name: str | None = None) -> Path:
    """`OUT/logs/rank{rank}.log` (or `OUT/logs/NAME`): this rank's bigtrain lines (INFO on every rank),
    DeepSpeed's log and the warnings, including those held since the process started. Returns the path."""
    path = Path(out_dir) / "logs" / (name or f"rank{rank}.log")
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, mode="a", encoding="utf-8", delay=False)
    handler.setLevel(logging.DEBUG)
    handler.setFormatter(logging.Formatter(FILE_FORMAT))
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "bigtrain_log_file", False)]:
        root.removeHandler(old)
        old.close()
    handler.bigtrain_log_file = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    if _sink is not None:
        _sink.attach(handler)
    return path


@contextlib.contextmanager
def library_stdout(name: str = DEEPSPEED_LOGGER) -> Iterator[None]:
    """What a library prints with `print` inside the block (DeepSpeed's "... op built successfully")
    goes to the sink as records of `name`; printed as usual when the routing is off or verbose."""
    divert = _sink is not None and any(isinstance(f, _Divert) and not f.verbose
                                       for f in logging.getLogger(DEEPSPEED_LOGGER).filters)
    if not divert:
        yield
        return
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            yield
    finally:
        for line in buffer.getvalue().splitlines():
            if line.strip():
                _sink.handle(logging.makeLogRecord({"name": name, "levelno": logging.INFO, "levelname": "INFO",
                                                    "msg": line}))
