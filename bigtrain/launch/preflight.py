"""`bigtrain preflight`: check a multi-node launch before a job is spent on it.

    bigtrain preflight --hostfile hostfile --config run.yaml --deepspeed_config ds_configs/zero3.json \\
        --gpus-per-node 8 --gpu-mem 80GiB

Checks, each a line on stdout when good and one line on stderr per problem (exit 2):
the hostfile (`HOST slots=N` lines, comments, no duplicates; a missing file is an error,
where DeepSpeed would silently train on this machine alone), that every host answers through
the chosen launcher, the batch triple for the total world size, and the memory per rank.
"""
from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from bigtrain.config.flags import FAMILY_HELP, FlagParser, add_run_config_args, shorthand_sets
from bigtrain.launch.hosts import HostEntry, HostfileError, is_local, read_hostfile, world_size

if TYPE_CHECKING:
    from bigtrain.config.run_config import RunConfig
    from bigtrain.ds.lint import DeviceCaps

LAUNCHERS = ("pdsh", "ssh", "no_ssh")


# --- the hosts ----------------------------------------------------------------------------------

def check_hosts(entries: list[HostEntry], launcher: str, timeout: float = 5.0) -> list[str]:
    """One problem per host that does not answer through `launcher` (local names are not contacted)."""
    if launcher == "no_ssh":
        return []  # every node starts its own launcher: nothing is contacted from here
    if shutil.which("ssh") is None:
        return ["ssh is not installed on this node; the pdsh and ssh launchers need it (or use --launcher no_ssh)"]
    problems = []
    if launcher == "pdsh" and len(entries) > 1 and shutil.which("pdsh") is None:  # one host: launched locally
        problems.append("pdsh is not installed on this node and is DeepSpeed's default multi-node launcher: install "
                        "it (apt-get install pdsh) or start one launcher per node with --no_ssh --node_rank R")
    remote = [e for e in entries if not is_local(e.host)]
    with ThreadPoolExecutor(max_workers=max(1, min(32, len(remote)))) as pool:
        found = list(pool.map(lambda e: check_host(e, timeout), remote))
    return problems + [p for p in found if p]


def check_host(entry: HostEntry, timeout: float = 5.0) -> str | None:
    """Resolve the name, then `ssh -o BatchMode=yes HOST test -x PYTHON`: reachable without a
    password prompt, and this repository's Python at the same path."""
    where = f"host {entry.host} (hostfile line {entry.line})"
    try:
        socket.getaddrinfo(entry.host, 22)
    except OSError as err:
        return f"{where} does not resolve ({err.strerror or err}); fix the name or add it to DNS / /etc/hosts"
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={int(timeout)}", entry.host, "test", "-x",
           sys.executable]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3 * timeout)
    except subprocess.TimeoutExpired:
        return f"{where} did not answer ssh within {3 * timeout:.0f} s"
    if proc.returncode == 255:
        reason = (proc.stderr.strip().splitlines() or ["ssh failed"])[-1]
        return (f"{where} does not answer ssh ({reason}); set up passwordless ssh from this node "
                f"(`ssh {entry.host} true` must work without a prompt) or use --launcher no_ssh")
    if proc.returncode != 0:
        return f"{where} has no {sys.executable}: every node needs this repository and its .venv at the same path"
    return None


# --- the job on that world size -----------------------------------------------------------------

def batch_report(run: RunConfig, world: int, ds_path: str | None, device: DeviceCaps,
                 sources: dict[str, str] | None = None) -> tuple[list[str], RunConfig]:
    """The lines describing the resolved batch triple, and the resolved run config (raises LintError).
    Resolved exactly as the runner resolves it (`bigtrain.ds.resolve.resolve`)."""
    from bigtrain.ds.resolve import resolve
    from bigtrain.parallel.split_rules import check_split_layout
    from bigtrain.config.topology import Topology
    resolved = resolve(run, ds_path, world, device, sources=sources)
    ds = resolved.ds_config
    check_split_layout(run, Topology.of(ds, world))  # a family that cannot split so, LoRA with TP, ...
    stages = resolved.run.pipeline.stages
    dp = world // stages
    lines = [f"batch: train_batch_size {ds['train_batch_size']} = micro {ds['train_micro_batch_size_per_gpu']} "
             f"x accum {ds['gradient_accumulation_steps']} x data-parallel {dp}"
             + (f" (world size {world} / {stages} pipeline stages)" if stages > 1 else "")]
    lines += [f"note: {note}" for note in resolved.notes]
    return lines, resolved.run


def memory_report(run: RunConfig, world: int, gpus_per_node: int, gpu_mem: int | None,
                  headroom: float = 0.1, device_name: str = "cuda") -> tuple[list[str], list[str]]:
    """(lines, problems): the estimated peak per rank on `device_name` ranks, and a problem if it does not
    fit `gpu_mem`."""
    from bigtrain.estimate.recommend import fits
    from bigtrain.estimate.of_run import estimate_run
    if run.model.pretrained:
        return ["memory: not estimated for a pretrained model directory (use `bigtrain estimate`)"], []
    est, _ = estimate_run(run, world, gpus_per_node, device_name, gpu_mem)
    gib = 2**30
    lines = [f"memory per rank (estimate, {est.setup.label}, {run.precision}, micro-batch {est.setup.micro_batch}): "
             f"{est.device_peak / gib:.2f} GiB on the device (model states {est.model_states / gib:.2f}, "
             f"activations {est.activations / gib:.2f}); {est.host_per_node / gib:.2f} GiB host memory per node"]
    if run.pipeline.stages > 1:
        lines.append("note: the estimate ignores pipeline stages (each stage holds only its layers)")
    problems = []
    if gpu_mem is not None and not fits(est, gpu_mem, None, headroom):
        problems.append(f"estimated {est.device_peak / gib:.2f} GiB per rank does not fit --gpu-mem "
                        f"{gpu_mem / gib:.1f} GiB with {headroom:.0%} headroom; see `bigtrain estimate --model "
                        f"{run.model.family} --size {run.model.size} --gpu-mem {gpu_mem / gib:.0f}GiB` "
                        "for setups that fit")
    return lines, problems


# --- the command --------------------------------------------------------------------------------

def device_caps(name: str) -> DeviceCaps:
    """What the nodes' accelerator supports, for the lint: this machine's, or a named kind."""
    from bigtrain.ds.lint import DeviceCaps
    here = DeviceCaps.detect()
    if name == "auto" or name == here.name:
        return here
    return DeviceCaps("cuda", fp16=True, bf16=True) if name == "cuda" else DeviceCaps("cpu", fp16=False, bf16=True)


def preflight(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(report lines, problems) for the parsed `bigtrain preflight` arguments."""
    from bigtrain.config.load import field_sources, load_run_config
    from bigtrain.ds.lint import LintError
    from bigtrain.estimate.memory_model import parse_memory
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        return [], [f"--gpus-per-node {args.gpus_per_node}: must be >= 1"]
    try:
        entries = read_hostfile(args.hostfile)
    except HostfileError as err:
        return [], err.problems
    world = world_size(entries, args.gpus_per_node)
    per_node = args.gpus_per_node or max(e.slots for e in entries)
    lines = [f"hostfile {args.hostfile}: {len(entries)} host(s), world size {world} "
             f"({' + '.join(str(min(e.slots, args.gpus_per_node or e.slots)) for e in entries)})"]
    problems = check_hosts(entries, args.launcher, args.ssh_timeout)
    if args.launcher == "no_ssh":
        lines.append("hosts: not contacted (no_ssh: start one launcher per node with --node_rank R)")
    else:
        names = [e.host + (" (this node)" if is_local(e.host) else "") for e in entries]
        lines.append(f"hosts: {', '.join(names)}: checked over ssh")
    try:
        gpu_mem = parse_memory(args.gpu_mem, "--gpu-mem") if args.gpu_mem else None
        shorthands = shorthand_sets(args)  # --model, --size
        run = load_run_config(args.config, shorthands + list(args.set))
        sources = field_sources(args.config, shorthands + list(args.set))
        device = device_caps(args.device)
        batch_lines, run = batch_report(run, world, args.deepspeed_config, device, sources)
        lines += batch_lines
        mem_lines, mem_problems = memory_report(run, world, per_node, gpu_mem, args.headroom, device.name)
        lines += mem_lines
        problems += mem_problems
    except LintError as err:
        problems += err.problems
    except ValueError as err:
        problems += str(err).splitlines()
    return lines, problems


def run_preflight(args: argparse.Namespace) -> int:
    lines, problems = preflight(args)
    for line in lines:
        print(line)
    for problem in problems:
        print(f"bigtrain preflight: {problem}", file=sys.stderr)
    print("preflight: " + ("OK" if not problems else f"{len(problems)} problem(s)"), file=sys.stderr)
    return 2 if problems else 0


def add_preflight_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `bigtrain preflight` on the CLI's subparsers."""
    p = subparsers.add_parser("preflight", help="check a hostfile, its hosts, the batch triple and memory",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hostfile", required=True, help="MPI-style hostfile: 'HOST slots=N' per line")
    p.add_argument("--launcher", choices=LAUNCHERS, default="pdsh",
                   help="how ranks start: pdsh (DeepSpeed's default, over ssh), ssh, or no_ssh "
                        "(one launcher per node with --node_rank); default pdsh")
    add_run_config_args(p)
    p.add_argument("--model", help=f"{FAMILY_HELP} (model.family)")
    p.add_argument("--size", help="model size (model.size), as for bigtrain/run.py")
    p.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config",
                   help="the DeepSpeed JSON the job will use (linted and fitted to the world size)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="ranks per node if fewer than the slots (deepspeed --num_gpus); default all slots")
    p.add_argument("--gpu-mem", default=None,
                   help="memory per accelerator, e.g. 80GiB: fail if the estimate exceeds it")
    p.add_argument("--headroom", type=float, default=0.1, help="share of --gpu-mem kept free (default 0.1)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="the nodes' accelerator for the lint (fp16/bf16 support); default: this machine's")
    p.add_argument("--ssh-timeout", type=float, default=5.0, help="ssh ConnectTimeout per host in seconds")
    p.set_defaults(func=run_preflight)


def main(argv: list[str] | None = None) -> int:
    """`python -m bigtrain.launch.preflight ...`, the same as `bigtrain preflight ...` (used by the slurm script)."""
    parser = FlagParser(prog="bigtrain")
    add_preflight_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["preflight", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
