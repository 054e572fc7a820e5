"""One machine's ranks started by DeepSpeed's per-node launcher (`deepspeed.launcher.launch`), without its runner.

On one machine the `deepspeed` runner only encodes the world (`localhost` and the first N slots, as
`deepspeed.launcher.runner.encode_world_info` writes it) and starts the per-node launcher with it, after importing
DeepSpeed and torch itself: about 1.9 CPU seconds and a process of every launch. bigtrain starts the per-node
launcher with the runner's own arguments instead. With a hostfile, or a launcher flag of the user's, the runner
stays (it reaches other machines and reads its own flags). One rank needs neither: `machine_command` starts it
as the per-node launcher would, without the launcher's process (its own import of DeepSpeed and torch).
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


def machine_command(num_ranks: int, master_port: int, target: list[str], *,
                    module: bool = False) -> tuple[list[str], dict[str, str]]:
    """The command that starts `num_ranks` ranks of `target` on this machine, and the variables it adds to the
    environment: the per-node launcher for several; for one, the rank itself with the arguments and the world the
    launcher gives its rank 0 of 1 (`--local_rank=0`; RANK, WORLD_SIZE, MASTER_ADDR, ...). The devices it sees are
    not narrowed to the first (the launcher's CUDA_VISIBLE_DEVICES=0): as `bigtrain train` starts one rank, its
    LOCAL_RANK picks the device."""
    if num_ranks > 1:
        return node_launch_command(num_ranks, master_port, target, module=module), {}
    cmd = [sys.executable, "-u", *(["-m"] if module else []), target[0], "--local_rank=0", *target[1:]]
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1",
           "CROSS_RANK": "0", "CROSS_SIZE": "1", "MASTER_ADDR": MASTER_ADDR, "MASTER_PORT": str(master_port)}
    return cmd, env
