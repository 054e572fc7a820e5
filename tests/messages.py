"""Assertions on what a message means rather than on its wording: the key, value, file or number it names
and the fix it gives, so that a reworded message still passes and a wrong one still fails."""
from __future__ import annotations

from collections.abc import Iterable


def naming(text: str | Iterable[str], *needles: str) -> bool:
    """Whether one line of `text` (a string of lines, or the lines) holds every needle."""
    lines = text.splitlines() if isinstance(text, str) else list(text)
    return any(all(needle in line for needle in needles) for line in lines)


def error_lines(stderr: str) -> list[str]:
    """bigtrain's lines of a process's stderr (`bigtrain: ...`) without its warnings (`bigtrain: warning: ...`), which
    speak of the machine rather than the run: another job building a DeepSpeed op on the same machine adds one to
    whatever job starts meanwhile. What "a mistake is one line" counts."""
    return [line for line in stderr.splitlines()
            if line.startswith("bigtrain:") and not line.startswith("bigtrain: warning:")]
