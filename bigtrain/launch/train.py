"""`bigtrain train ...`: the deepspeed launcher around bigtrain/run.py, with sensible rank and thread counts."""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

RUN_SCRIPT = Path(__file__).resolve().parents[1] / "run.py"
# glibc malloc for CPU ranks: never mmap/munmap large blocks, never trim the heap (docs/benchmarks.md).
MALLOC_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"


def default_num_ranks() -> int:
    """One rank per GPU; on a CPU-only host two ranks (the smallest real data-parallel job), one per core."""
    try:
        import torch
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return torch.cuda.device_count()
    except ImportError:
        pass
    return max(1, min(2, os.cpu_count() or 1))


def launcher_command(run_args: list[str], num_ranks: int, hostfile: str | None, master_port: int | None,
                     launcher_args: list[str]) -> list[str]:
    deepspeed = shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed")
    cmd = [deepspeed]
    if hostfile:
        if not Path(hostfile).is_file():  # DeepSpeed would silently fall back to this machine
            raise ValueError(f"hostfile {hostfile} does not exist; give an existing file (see hostfile.example)")
        cmd += ["--hostfile", hostfile]
    else:
        cmd += ["--num_gpus", str(num_ranks)]
    if master_port:
        cmd += ["--master_port", str(master_port)]
    return cmd + launcher_args + [str(RUN_SCRIPT), *run_args]


def thread_env(num_ranks: int) -> dict:
    """The ranks' environment: the cores split between the ranks unless the user chose OMP_NUM_THREADS,
    and glibc malloc keeping freed memory unless GLIBC_TUNABLES is set (docs/benchmarks.md has the numbers;
    each rank also pins itself to its share of the cores, see `distributed.bind_to_cores`)."""
    env = dict(os.environ)
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(num_ranks, 1)))
    env.setdefault("GLIBC_TUNABLES", MALLOC_TUNABLES)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    from bigtrain.distributed.device import fix_cuda_arch_list
    fix_cuda_arch_list(env)  # the ranks would otherwise fail building DeepSpeed's FusedAdam
    return env


def cmd_train(args: argparse.Namespace) -> int:
    num_ranks = args.num_gpus or default_num_ranks()
    cmd = launcher_command(args.run_args, num_ranks, args.hostfile, args.master_port, args.launcher_arg)
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    # DeepSpeed's single-node runner dies on SIGTERM without telling its ranks; run it in a
    # session of its own and pass SIGTERM/SIGINT to the whole session, so every rank saves.
    child = subprocess.Popen(cmd, env=thread_env(num_ranks), start_new_session=True)

    def forward(signum: int, frame: object) -> None:
        os.killpg(child.pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    return child.wait()


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="launch bigtrain/run.py through the deepspeed launcher",
                       description="Everything after the launcher options goes to bigtrain/run.py "
                                   "(e.g. --model gpt2 --size small --steps 1000 --set zero.stage=3).")
    p.add_argument("--num-gpus", type=int, default=None, help="ranks on this machine (default: GPUs, or 2 on CPU)")
    p.add_argument("--hostfile", default=None, help="multi-node hostfile (see hostfile.example)")
    p.add_argument("--master-port", type=int, default=None, help="rendezvous port")
    p.add_argument("--launcher-arg", action="append", default=[],
                   help="extra argument for the deepspeed launcher, e.g. --launcher-arg=--bind_cores_to_rank")
    p.set_defaults(run_args=[], passes_unknown_args=True)  # everything else goes to run.py
    p.set_defaults(func=cmd_train)
