"""One machine's ranks started by DeepSpeed's per-node launcher (`deepspeed.launcher.launch`), without its runner.

On one machine the `deepspeed` runner only encodes the world (`localhost` and the first N slots, as
`deepspeed.launcher.runner.encode_world_info` writes it) and starts the per-node launcher with it, after importing
DeepSpeed and torch itself: about 1.9 CPU seconds and a process of every launch. bigtrain starts the per-node
launcher with the runner's own arguments instead. With a hostfile, or a launcher flag of the user's, the runner
stays (it reaches other machines and reads its own flags).
"""
from __future__ import annotations

import base64
import json
import sys

MASTER_ADDR = "127.0.0.1"  # what the runner gives one machine's launch
DEFAULT_PORT = 29500  # the runner's default --master_port


def world_info(num_ranks: int) -> str:
    """The runner's `--world_info` for `num_ranks` ranks on this machine (urlsafe base64 of its JSON)."""
    return base64.urlsafe_b64encode(json.dumps({"localhost": list(range(num_ranks))}).encode("utf-8")).decode("utf-8")


def node_launch_command(num_ranks: int, master_port: int | None, target: list[str], *, module: bool = False,
                        log_level: str | None = None) -> list[str]:
    """`python -u -m deepspeed.launcher.launch --world_info=... TARGET`, as the runner starts it on one machine.

    `target`: the script (or, with `module`, the module) and its arguments; `log_level`: the launcher's own
    (None: its default, info)."""
    cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world_info(num_ranks)}",
           f"--master_addr={MASTER_ADDR}", f"--master_port={master_port or DEFAULT_PORT}"]
    if module:
        cmd.append("--module")
    if log_level:
        cmd.append(f"--log_level={log_level}")
    return cmd + target
