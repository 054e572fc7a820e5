"""Where the ranks of a job on one machine meet: the launcher variables of a world of one, and a free port.

Light (no torch): `bigtrain train` picks its port here before any rank starts.
"""
from __future__ import annotations

import os
import socket


def single_process_env() -> None:
    """A plain `python bigtrain/run.py` has no launcher variables: make it a world of one."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "0")  # the store of a world of one binds a port the kernel picks: no race


def free_port() -> int:
    """A TCP port no process listens on now (the rendezvous binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
