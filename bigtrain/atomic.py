"""Files written whole or not at all: the one writer every part of bigtrain uses for a file someone reads back (a
summary, a checkpoint's marker, a prepared shard, a reference table, eval results, a plot, a docs page).

The bytes go to a temporary beside the file (same folder, so the rename never crosses a filesystem), the temporary is
fsynced, renamed over the file, and the folder is fsynced. A reader (another process, a resumed job) sees the old file
or the new one, never half of one; a job killed mid-write leaves the old file and a stray temporary that no reader
opens; and after a power cut the file is the old one or the new one, never the new name on empty contents (the
rename reaching the disk before the data, which a rename without fsync allows on ext4, xfs and btrfs)."""
from __future__ import annotations

import contextlib
import errno
import glob
import os
from pathlib import Path
from typing import IO, Any, Iterator


def temporary_for(path: Path) -> Path:
    """The temporary this process writes `path` under: hidden, and named for the writer, so that two processes
    writing one file never write into each other's temporary."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def temporaries(path: str | os.PathLike) -> list[Path]:
    """Temporaries of `path` left in its folder by any writer (a killed job's half file), for an owner that knows
    no other writer is at work (a prepare's shard folder, a reference table) to remove."""
    path = Path(path)
    return sorted(path.parent.glob(f".{glob.escape(path.name)}.*.tmp"))


@contextlib.contextmanager
def replacing(path: str | os.PathLike, mode: str = "wb", **open_kwargs: Any) -> Iterator[IO]:
    """Open a temporary for writing `path`; when the block ends without an error the temporary becomes `path`
    (fsynced, renamed, its folder fsynced), and on an error it is removed and `path` is left as it was."""
    if "w" not in mode:
        raise ValueError(f"replacing() writes a file whole: mode {mode!r} must be 'w' or 'wb'")
    path = Path(path)
    tmp = temporary_for(path)
    try:
        with open(tmp, mode, **open_kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)


def write_atomic(path: str | os.PathLike, data: str | bytes, encoding: str = "utf-8") -> Path:
    """Write `data` (text as `encoding`) as the whole of `path`, atomically and durably; returns the path."""
    path = Path(path)
    with replacing(path, "wb") as f:
        f.write(data.encode(encoding) if isinstance(data, str) else data)
    return path


def fsync_folder(folder: str | os.PathLike) -> None:
    """Make a rename in `folder` durable: the folder's entry is what names the new file."""
    if os.name == "nt":  # Windows cannot open a folder to fsync it
        return
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP):  # a filesystem that syncs no folders (some FUSE, 9p)
            raise
    finally:
        os.close(fd)
