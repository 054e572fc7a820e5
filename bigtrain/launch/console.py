"""The launcher's and the ranks' output on the way to the console of `bigtrain train`: the DeepSpeed launcher's
line for a rank that ended with bigtrain's own stop (exit 2, a user's mistake; 3, a diverging run; 130 / 143, a
signal's stop) is left out, as that stop has already said everything in one `bigtrain:` line. Every other byte
passes through as it comes (progress bars included); a rank that died otherwise keeps the launcher's line.
"""
from __future__ import annotations

import os
import re
import threading
from typing import BinaryIO, TextIO

# deepspeed/launcher/launch.py: "[date] [ERROR] [launch.py:NNN:sigkill_handler] [argv...] exits with return code = 2"
# 130 / 143: a rank's lifeline ending it on SIGINT / SIGTERM, after its own line (a rank killed by a signal it did
# not handle is reported as -2 / -15, and keeps the launcher's line)
BIGTRAIN_STOP = re.compile(rb"\[launch\.py:\d+:sigkill_handler\].* exits with return code = ([23]|130|143)\s*$")
LINE_START = re.compile(rb"[\r\n]\[")  # where a log line may begin (after a line, or a progress bar's update)


def keep(line: bytes) -> bool:
    return not BIGTRAIN_STOP.search(line)


def copy_filtered(source: BinaryIO, console: TextIO) -> threading.Thread:
    """Copy `source` to `console` (sys.stdout or sys.stderr) in a thread: whole lines where a line may be the
    launcher's (it starts with "["), as it comes otherwise; returns the started thread (ends when `source` does)."""
    raw = getattr(console, "buffer", None)  # a captured console (tests) takes text

    def write(data: bytes) -> None:
        if raw is not None:
            raw.write(data)
            raw.flush()
        else:
            console.write(data.decode(errors="replace"))
            console.flush()

    def run() -> None:
        held = b""
        while chunk := os.read(source.fileno(), 65536):
            held += chunk
            out = b""
            while held:
                if not held.startswith(b"["):  # not a log line: everything up to one that may be
                    start = LINE_START.search(held)
                    cut = len(held) if start is None else start.start() + 1
                    out, held = out + held[:cut], held[cut:]
                    continue
                end = held.find(b"\n")
                if end < 0:
                    break  # a log line still arriving: wait for its end
                line, held = held[:end + 1], held[end + 1:]
                out += line if keep(line) else b""
            if out:
                write(out)
        if held and keep(held):
            write(held)

    thread = threading.Thread(target=run, name="bigtrain-console", daemon=True)
    thread.start()
    return thread
