"""Whether a folder a verb is told to write (a run's --out, an export's, a prepare's) can be had, found before any
work and without creating anything: a file in its place, a read-only mount or a folder without permission is one
line naming the flag, where the first mkdir would have raised a traceback minutes into the job."""
from __future__ import annotations

import os
from pathlib import Path


def unwritable(folder: str | os.PathLike, flag: str, named: str | os.PathLike | None = None) -> str | None:
    """The line for a `folder` (given with `flag`) that this process cannot create or write into; None when it can.
    `named`: the path the line names when the folder checked is the one it is written beside (an export's)."""
    folder = Path(folder).expanduser().absolute()
    named = Path(named).expanduser().absolute() if named is not None else folder
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        return f"{flag} {named}: {existing} is a file, not a folder; give {flag} a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        why = "is not writable" if existing == named else f"cannot be made: {existing} is not writable"
        return f"{flag} {named} {why} (a read-only file system, or no permission); give {flag} a folder you can write"
    return None
