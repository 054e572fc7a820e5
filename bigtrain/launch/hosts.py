"""Where a launch starts its ranks: the hosts of an MPI-style hostfile, read as DeepSpeed's launcher reads it, or
this machine's devices.

A missing or bad hostfile is an error here (every bad line named at once), where DeepSpeed would silently train
on this machine alone.
"""
from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}


@dataclass(frozen=True)
class HostEntry:
    host: str
    slots: int
    line: int  # 1-based line number in the hostfile


class HostfileError(ValueError):
    """One or more problems, one line each."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


def read_hostfile(path: str | Path) -> list[HostEntry]:
    """Read an MPI-style hostfile as DeepSpeed's launcher reads it (`deepspeed.launcher.runner.fetch_hostfile`:
    `HOST slots=N`, anything after it ignored, e.g. OpenMPI's `max_slots=M` or a `# comment`), with every
    bad line named at once; raises HostfileError. A missing file is an error here, where DeepSpeed would
    train on this machine alone."""
    path = Path(path)
    if not path.is_file():
        raise HostfileError([f"hostfile {path} does not exist; DeepSpeed would silently train on this machine "
                              "only. Give an existing file (see hostfile.example)"])
    entries: list[HostEntry] = []
    problems: list[str] = []
    for number, text in enumerate(path.read_text().splitlines(), start=1):
        parsed = parse_hostfile_line(text, number, path)
        if isinstance(parsed, str):
            problems.append(parsed)
        elif parsed is not None:
            first = next((e for e in entries if e.host == parsed.host), None)
            if first is not None:
                problems.append(f"{path}:{number}: host {parsed.host} is listed twice (lines {first.line} and "
                                f"{number}); list each host once with all its slots")
            else:
                entries.append(parsed)
    if not entries and not problems:
        problems.append(f"{path} lists no hosts; add one line per host like 'worker-1 slots=8'")
    if problems:
        raise HostfileError(problems)
    from deepspeed.launcher.runner import fetch_hostfile
    pool = fetch_hostfile(str(path))  # the launcher's own reading decides hosts and slots
    lines = {e.host: e.line for e in entries}
    return [HostEntry(host, slots, lines.get(host, 0)) for host, slots in pool.items()]


# deepspeed.launcher.runner._parse_hostfile's pattern: a host, then slots=N; the rest of the line is ignored
_HOST_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")


def parse_hostfile_line(text: str, number: int, path: Path | str = "hostfile") -> HostEntry | str | None:
    """An entry, None for a blank or comment line, or a one-line problem (the lines DeepSpeed rejects,
    and slots=0, which DeepSpeed would take for a host that starts no rank)."""
    body = text.strip()
    if not body or body.startswith("#"):
        return None
    match = _HOST_LINE.search(body)
    fields = body.split()
    if match is None and len(fields) >= 2 and fields[1].startswith("slots="):
        return f"{path}:{number}: {fields[1]} for {fields[0]}: slots must be a positive integer (ranks on that host)"
    if match is None:
        return f"{path}:{number}: {body!r}: expected 'HOSTNAME slots=N', e.g. 'worker-1 slots=8' (max_slots=M may follow)"
    host, slots = match.group(1), int(match.group(2))
    if slots < 1:
        return f"{path}:{number}: slots={slots} for {host}: slots must be a positive integer (ranks on that host)"
    return HostEntry(host, slots, number)


def world_size(entries: list[HostEntry], gpus_per_node: int | None = None) -> int:
    """Ranks the launcher starts: every slot, or the first `gpus_per_node` of each host (`--num_gpus`)."""
    return sum(min(e.slots, gpus_per_node) if gpus_per_node else e.slots for e in entries)


def is_local(host: str) -> bool:
    return host in LOCAL_NAMES or host == socket.gethostname()


def ranks_here(hostfile: str) -> int:
    """Ranks the launcher starts on this node for `hostfile`: this host's slots, or the most slots of any host when
    this node is not listed by name."""
    entries = read_hostfile(hostfile)  # HostfileError (a ValueError) names each bad line
    mine = [e.slots for e in entries if is_local(e.host) or e.host == socket.getfqdn()]
    return mine[0] if mine else max(e.slots for e in entries)


def default_num_ranks() -> int:
    """One rank per GPU; on a CPU-only host two ranks (the smallest real data-parallel job), one per core."""
    from bigtrain.distributed.device import cpu_only_install
    if cpu_only_install():  # known from the installed files: no torch import (~1.2 CPU s) in the launching process
        return max(1, min(2, os.cpu_count() or 1))
    try:
        import torch
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return torch.cuda.device_count()
    except ImportError:
        pass
    return max(1, min(2, os.cpu_count() or 1))
