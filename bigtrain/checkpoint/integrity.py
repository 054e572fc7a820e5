"""Is a checkpoint whole? Its marker lists every file with its size and an xxh3 digest of its bytes.

Two checks, from cheap to thorough. `check_complete` reads the marker, looks for every listed file and
reads the tail of each torch file (a file cut short is not a complete zip archive): it catches an
interrupted save, a deleted file and a truncated one. `damaged_files` reads every byte and compares
each file's digest with the one recorded at save time: it catches bytes overwritten in place, which
leave the size and the archive's directory as they were. xxh3 hashes at memory speed (several GB/s a
core), and the ranks of a job share the files between them, so reading the checkpoint is what it costs.
"""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

import torch

from bigtrain.checkpoint.state import MARKER
from bigtrain.distributed.world import World

MANIFEST = "files"  # in the marker: relative path -> size in bytes of every file of the tag at save time
DIGESTS = "digests"  # in the marker: relative path -> xxh3_64 hex digest of the file's bytes at save time
_CHUNK = 16 << 20


def tag_files(tag_dir: Path) -> list[str]:
    """Every file of a tag directory but the marker (and a marker being written), sorted, relative."""
    return [str(p.relative_to(tag_dir)) for p in sorted(tag_dir.rglob("*"))
            if p.is_file() and p.name != MARKER and not p.name.endswith(".tmp")]


def file_digest(path: Path) -> str:
    import xxhash
    digest = xxhash.xxh3_64()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def digests(tag_dir: Path, names: list[str], world: World | None = None) -> dict[str, str]:
    """{name: digest} of `names`; a collective when `world` has several ranks, each hashing a share."""
    rank, size = (world.rank, world.size) if _collective(world) else (0, 1)
    mine = {name: file_digest(tag_dir / name) for name in names[rank::size] if (tag_dir / name).is_file()}
    if size == 1:
        return mine
    shares: list = [None] * size
    torch.distributed.all_gather_object(shares, mine)
    return {name: digest for share in shares for name, digest in share.items()}


def damaged_files(tag_dir: Path, world: World | None = None) -> list[str]:
    """The files whose bytes differ from those the marker recorded (none for a marker without digests, as
    bigtrain wrote before it recorded them). A collective when `world` has several ranks."""
    recorded = json.loads((tag_dir / MARKER).read_text()).get(DIGESTS) or {}
    now = digests(tag_dir, sorted(recorded), world)
    return [name for name in sorted(recorded) if now.get(name) != recorded[name]]


def check_complete(tag_dir: Path) -> str | None:
    """Why `tag_dir` cannot be resumed from, or None if it can (the cheap check: no file is read whole)."""
    marker = tag_dir / MARKER
    if not marker.is_file():
        return "no completion marker (the save was interrupted)"
    try:
        state = json.loads(marker.read_text())
    except json.JSONDecodeError:
        return "its completion marker is not valid JSON"
    world = int(state.get("world_size", 1))
    expected = set(state.get(MANIFEST) or {}) | {f"rng_rank{r}.pt" for r in range(world)}
    missing = sorted(name for name in expected if not (tag_dir / name).is_file())
    if missing:
        return f"missing {', '.join(missing[:3])}" + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    return _damaged_torch_file(tag_dir, state.get(MANIFEST) or {})


def _damaged_torch_file(tag_dir: Path, sizes: dict) -> str | None:
    """The first torch file that is empty or cut short. torch.save writes a zip archive whose
    directory sits at the end, so a truncated file fails `is_zipfile`, which reads only the tail."""
    for path in sorted(tag_dir.rglob("*.pt")):
        name, size = str(path.relative_to(tag_dir)), path.stat().st_size
        if size == 0:
            return f"{name} is empty"
        if not zipfile.is_zipfile(path):
            saved = f", {sizes[name]} when it was saved" if name in sizes else ""
            return f"{name} is truncated or corrupt (not a complete torch file: {size} bytes{saved})"
    return None


def _collective(world: World | None) -> bool:
    return world is not None and world.size > 1 and torch.distributed.is_initialized()
