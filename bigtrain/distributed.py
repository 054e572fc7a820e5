"""Process-group set-up that works under the deepspeed launcher, torchrun, and a plain `python`."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch


@dataclass(frozen=True)
class World:
    rank: int
    local_rank: int
    size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(timeout_minutes: float | None = None) -> World:
    """Join (or, for a plain `python` run, create) the process group with the accelerator's backend.

    The collective timeout comes from DEEPSPEED_TIMEOUT (minutes) so a dead peer ends the job
    instead of hanging it for DeepSpeed's default 30 minutes.
    """
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    _single_process_env()
    minutes = timeout_minutes or float(os.environ.get("DEEPSPEED_TIMEOUT", "10"))
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                                   timeout=timedelta(minutes=minutes), auto_mpi_discovery=False)
    world = World(torch.distributed.get_rank(), int(os.environ.get("LOCAL_RANK", "0")),
                  torch.distributed.get_world_size())
    if get_accelerator().device_name() != "cpu":
        get_accelerator().set_device(world.local_rank)
    return world


def _single_process_env() -> None:
    """A plain `python bigtrain/run.py` has no launcher variables: make it a world of one."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def shutdown() -> None:
    """A barrier and an orderly teardown; exiting without it sometimes aborts in gloo's destructor."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def all_reduce_max_flag(flag: bool, device: torch.device | str) -> bool:
    """True on every rank if it is True on any (e.g. one rank got SIGTERM)."""
    if not torch.distributed.is_initialized():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item() > 0)


def all_reduce_mean(values: list[float], device: torch.device | str, group=None) -> list[float]:
    """Mean of each value over the ranks of `group` (all ranks by default), in fp64."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(t, group=group)
        t /= torch.distributed.get_world_size(group)
    return t.tolist()
