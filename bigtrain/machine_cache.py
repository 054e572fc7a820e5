"""bigtrain's machine-wide cache folder: what a run would otherwise compute again on every start of this machine (a
BPE trained on the same text, the host's CPU described)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path | None:
    """BIGTRAIN_CACHE, else $XDG_CACHE_HOME/bigtrain, else ~/.cache/bigtrain; BIGTRAIN_CACHE=off keeps nothing there."""
    chosen = os.environ.get("BIGTRAIN_CACHE")
    if chosen == "off":
        return None
    if chosen:
        return Path(chosen).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bigtrain"
