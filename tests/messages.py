"""Assertions on what a message means rather than on its wording: the key, value, file or number it names
and the fix it gives, so that a reworded message still passes and a wrong one still fails."""
from __future__ import annotations

from collections.abc import Iterable


def naming(text: str | Iterable[str], *needles: str) -> bool:
    """Whether one line of `text` (a string of lines, or the lines) holds every needle."""
    lines = text.splitlines() if isinstance(text, str) else list(text)
    return any(all(needle in line for needle in needles) for line in lines)
