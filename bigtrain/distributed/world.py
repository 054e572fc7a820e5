"""Process-group set-up that works under the deepspeed launcher, torchrun, and a plain `python`, and the
few collectives the loop needs (the peers of a job: `peers`; how it ends: `peer_watch`, `job_stop`)."""
from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from bigtrain.distributed.host import describe_cpu_once, tune_cpu_rank
from bigtrain.distributed.op_builds import build_lines, comm_op, use_environment_ops_dir
from bigtrain.distributed.op_locks import clear_stale_build_locks
from bigtrain.distributed.rendezvous import single_process_env


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

    single_process_env()
    describe_cpu_once()  # DeepSpeed's CPU Adam asks py-cpuinfo six times, each a process of its own
    if get_accelerator().device_name() == "cpu" and not torch.distributed.is_initialized():
        tune_cpu_rank()  # before gloo starts its threads, so they inherit the binding
    minutes = timeout_minutes or collective_timeout_s() / 60
    use_environment_ops_dir()  # this environment's builds (unless TORCH_EXTENSIONS_DIR is set), for every op
    if not torch.distributed.is_initialized() and os.environ.get("LOCAL_RANK", "0") == "0":
        for line in build_lines([comm_op()]):  # one line per machine while its ranks wait for the build
            print(f"bigtrain: {line}", file=sys.stderr, flush=True)
    for lock in clear_stale_build_locks():  # DeepSpeed builds its CPU ops (shm all-reduce) while it joins
        print(f"bigtrain: removed {lock}, a stale lock of a killed op build that every rank would wait on forever",
              file=sys.stderr, flush=True)
    if not torch.distributed.is_initialized():
        from bigtrain.metrics.logs import library_stdout
        with library_stdout():  # DeepSpeed prints "... shm_comm_op built successfully": to the rank's log
            deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                                       timeout=timedelta(minutes=minutes), auto_mpi_discovery=False)
    world = World(torch.distributed.get_rank(), int(os.environ.get("LOCAL_RANK", "0")),
                  torch.distributed.get_world_size())
    if get_accelerator().device_name() != "cpu":
        get_accelerator().set_device(world.local_rank)
    else:
        release_shm_buffer(world)
    return world


def collective_timeout_s() -> float:
    """How long a collective may wait for its peers: DEEPSPEED_TIMEOUT minutes (default 10), as DeepSpeed reads it."""
    return 60.0 * float(os.environ.get("DEEPSPEED_TIMEOUT", "10"))


def release_shm_buffer(world: World) -> None:
    """Unlink this rank's /dev/shm all-reduce buffer once every rank has mapped it.

    DeepSpeed's CPU backend (ops/csrc/cpu/comm/shm.cpp) gives each rank of a single-host job a
    ~69 MB shared-memory file and never unlinks it: every job left world-size files in RAM
    (tmpfs) behind, 21 GB on this 24 GB machine after a few hundred test jobs. After the barrier
    every rank has mapped all buffers; the mappings outlive the names, and the memory returns
    when the ranks exit, however they exit.
    """
    local_size = os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE"))
    if world.size < 2 or local_size != str(world.size):  # DeepSpeed only uses shm when all ranks are local
        return
    name = (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{world.rank}")
    torch.distributed.barrier()
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except OSError:  # no shm op built here, or not Linux
        pass


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def shutdown() -> None:
    """A barrier and an orderly teardown; exiting without it sometimes aborts in gloo's destructor."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def exit_now(code: int) -> None:
    """End a rank's process once its work is over (files written, process group destroyed) without the
    interpreter's teardown: there, a DeepSpeed/gloo thread that is still joinable sometimes aborts the process
    ("terminate called without an active exception"), and a finished job would report exit status 250."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def reduce_step(loss: torch.Tensor, stop_requested: bool,
                metrics: dict[str, torch.Tensor] | None = None) -> tuple[float, bool, dict[str, float]]:
    """The one collective and host sync of a training step: `loss` (a scalar on the device) averaged over all
    ranks, whether any rank was asked to stop (one got SIGTERM, say), and the objective's `metrics` (scalars on
    the device: a router loss, DPO's rewards, ...) averaged too. Every rank has the same metric names."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    sums = sum_over_ranks({("loss",): loss, ("stop",): 1.0 if stop_requested else 0.0,
                           **{("metric", name): value for name, value in (metrics or {}).items()}}, loss.device)
    return (sums[("loss",)] / world, sums[("stop",)] > 0,
            {key[1]: value / world for key, value in sums.items() if key[0] == "metric"})


def sum_over_ranks(values: dict[Any, torch.Tensor | float], device: torch.device | str) -> dict[Any, float]:
    """Each named scalar (a tensor on `device`, or a number) summed over all ranks in fp64: one all-reduce and one
    host sync, however many there are."""
    keys = sorted(values, key=str)
    packed = torch.zeros(len(keys), dtype=torch.float64, device=device)
    for i, key in enumerate(keys):
        value = values[key]
        packed[i] = value.detach() if isinstance(value, torch.Tensor) else value  # device to device: no sync yet
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(packed)
    return dict(zip(keys, packed.tolist()))


def all_reduce_mean(values: list[float], device: torch.device | str, group=None) -> list[float]:
    """Mean of each value over the ranks of `group` (all ranks by default), in fp64."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(t, group=group)
        t /= torch.distributed.get_world_size(group)
    return t.tolist()


def all_ranks_agree(flag: bool) -> bool:
    """Whether `flag` holds on every rank (a collective; `flag` itself without a process group)."""
    return smallest_over_ranks(1.0 if flag else 0.0) > 0


def smallest_over_ranks(value: float) -> float:
    """The smallest of each rank's `value` (a collective; `value` itself without a process group)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    from deepspeed.accelerator import get_accelerator
    packed = torch.tensor([value], dtype=torch.float64, device=get_accelerator().current_device_name())
    torch.distributed.all_reduce(packed, op=torch.distributed.ReduceOp.MIN)
    return float(packed.item())
