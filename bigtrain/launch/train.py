"""`bigtrain train ...`: the deepspeed launcher around `bigtrain.run`, with sensible rank and thread counts.

The ranks run `python -m bigtrain.run` (the launcher's `--module`), so an installed package
needs no checkout. The console shows bigtrain's lines: the launcher's INFO lines and DeepSpeed's
per-process accelerator warning stay out (`--verbose` shows them; each rank keeps DeepSpeed's
log in OUT/logs/rank{R}.log either way). A run config that does not load, and the mistakes that need no rank (an
output folder holding another run, a model directory of another family, data of the wrong shape, an unknown
evaluation task: `bigtrain.train.precheck`) are one line before any rank starts, and a rank's own stop is not
repeated by the launcher's line (`bigtrain.launch.console`).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from bigtrain.distributed.rendezvous import free_port
from bigtrain.launch.console import copy_filtered
from bigtrain.launch.hosts import default_num_ranks, ranks_here
from bigtrain.launch.signals import pass_signal, wait_for_session

RUN_MODULE = "bigtrain.run"
# glibc malloc for CPU ranks: never mmap/munmap large blocks, never trim the heap (docs/benchmarks.md).
MALLOC_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"


def launcher_command(run_args: list[str], num_ranks: int | None, hostfile: str | None, master_port: int | None,
                     launcher_args: list[str], verbose: bool = False, module: str = RUN_MODULE) -> list[str]:
    """`deepspeed [--hostfile F | --num_gpus N] [--master_port P] --module bigtrain.run RUN_ARGS`; on one machine
    without launcher flags, the per-node launcher the runner would start (`bigtrain.launch.node`).

    With a hostfile, `num_ranks` (from --num-gpus) limits the ranks per node, as `deepspeed --num_gpus` does.
    `module`: what the ranks run (`bigtrain eval` launches `bigtrain.eval`).
    """
    run_args = [*run_args, "--verbose"] if verbose and "--verbose" not in run_args else run_args
    if not hostfile and not launcher_args:
        from bigtrain.launch.node import node_launch_command
        # The launcher's INFO lines (world info, spawned pids) stay out; its errors (a rank that died) still show.
        return node_launch_command(num_ranks or default_num_ranks(), master_port, [module, *run_args], module=True,
                                   log_level=None if verbose else "error")
    deepspeed = shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed")
    cmd = [deepspeed]
    if hostfile:
        ranks_here(hostfile)  # a missing or bad file stops here: DeepSpeed would train on this machine alone
        cmd += ["--hostfile", hostfile]
        if num_ranks:
            cmd += ["--num_gpus", str(num_ranks)]
    else:
        cmd += ["--num_gpus", str(num_ranks or default_num_ranks())]
    if master_port:
        cmd += ["--master_port", str(master_port)]
    if not verbose and not any(a.startswith(("--log_level", "--log-level", "-q", "--quiet")) for a in launcher_args):
        # The launcher's INFO lines (cmd, world info, spawned pids) and its "Unable to find hostfile" warning
        # (bigtrain checks --hostfile itself) stay out; its errors (a rank that died) still show.
        cmd += ["--log_level", "error"]
    return cmd + launcher_args + ["--module", module, *run_args]


def launch_env(num_ranks: int, verbose: bool = False) -> dict:
    """The launcher's and its ranks' environment (`thread_env`), with the accelerator detected once here unless
    --verbose: DeepSpeed's "Setting accelerator to CPU" is then said by neither the launcher nor any rank."""
    from bigtrain.distributed.device import accelerator_name
    env = thread_env(num_ranks)
    if not verbose and "DS_ACCELERATOR" not in env and (name := accelerator_name()):
        env["DS_ACCELERATOR"] = name
    return env


def thread_env(num_ranks: int) -> dict:
    """The ranks' environment: the cores split between the ranks unless the user chose OMP_NUM_THREADS,
    and glibc malloc keeping freed memory unless GLIBC_TUNABLES is set (docs/benchmarks.md has the numbers;
    each rank also pins itself to its share of the cores, see `distributed.host.bind_to_cores`); DeepSpeed's
    ops built in this environment's folder (`distributed.op_builds`)."""
    env = dict(os.environ)
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(num_ranks, 1)))
    env.setdefault("GLIBC_TUNABLES", MALLOC_TUNABLES)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    from bigtrain.distributed.op_builds import use_environment_ops_dir
    use_environment_ops_dir(env)  # DeepSpeed's ops built once for this environment, not over another's
    from bigtrain.distributed.device import fix_cuda_arch_list
    fix_cuda_arch_list(env)  # the ranks would otherwise fail building DeepSpeed's FusedAdam
    return env


def check_run_args(run_args: list[str], files_here: bool = True, world_size: int | None = None) -> str | None:
    """The one-line complaint about these arguments, before any rank starts (None: none found): the run config, and
    with `files_here` (rank 0 runs on this machine) what needs no rank (`bigtrain.train.precheck`: the output folder,
    the model directory, the data's format and first records, the evaluation tasks, and at `world_size` ranks the
    batch)."""
    from bigtrain.config.flags import build_run_parser, config_sources, run_config_from_args
    parser = build_run_parser()
    args, unknown = parser.parse_known_args(run_args)
    if unknown:
        return unknown_flag_line(unknown[0], parser, unknown[1] if len(unknown) > 1 else None)
    try:
        run = run_config_from_args(args)
        if files_here:
            from bigtrain.train.precheck import check_run
            check_run(run, resume=args.resume, overwrite=args.overwrite, world_size=world_size,
                      ds_config=args.deepspeed_config, sources=config_sources(args))
    except ValueError as err:
        return str(err)
    return None


def launched_world_size(args: argparse.Namespace, num_ranks: int) -> int | None:
    """The ranks `bigtrain train` starts: `num_ranks` on this machine, or a hostfile's slots (each host's first
    --num-gpus); None where a launcher option chooses them (--include, --exclude, --num_nodes)."""
    chosen = ("--include", "--exclude", "--num_nodes", "--num-nodes", "-i", "-e")
    if any(arg.split("=", 1)[0] in chosen for arg in args.launcher_arg):
        return None
    if args.hostfile:
        from bigtrain.launch.hosts import read_hostfile, world_size
        return world_size(read_hostfile(args.hostfile), args.num_gpus)
    return num_ranks


def rank_0_here(hostfile: str | None) -> bool:
    """Whether rank 0 runs on this machine (DeepSpeed puts it on the hostfile's first host), whose folders the
    launching process can then check as rank 0 will see them."""
    if not hostfile:
        return True
    from bigtrain.launch.hosts import is_local, read_hostfile
    return is_local(read_hostfile(hostfile)[0].host)


def unknown_flag_line(flag: str, run_parser: argparse.ArgumentParser, following: str | None = None) -> str:
    """One line for an argument neither `bigtrain train` nor bigtrain.run takes, with the nearest one of theirs
    (`following`: the argument after it, the value a run-config field given as a flag was meant to get)."""
    import difflib
    ours = ["--num-gpus", "--hostfile", "--master-port", "--launcher-arg", "--verbose"]
    theirs = [s for a in run_parser._actions for s in a.option_strings if s.startswith("--")]
    name = flag.split("=", 1)[0]
    if "." in name.lstrip("-"):  # a run-config field given as a flag (--lora.r 8): --local_rank is no help
        value = flag.split("=", 1)[1] if "=" in flag else following if following and following[0] != "-" else "VALUE"
        return f"unknown argument {flag!r}; a run-config field goes through --set: --set {name.lstrip('-')}={value}"
    near = difflib.get_close_matches(name.replace("_", "-"), ours + theirs, n=1, cutoff=0.6)
    hint = (f"; did you mean {near[0]}?" if near
            else "; `bigtrain train --help` and `python -m bigtrain.run --help` list them")
    return f"unknown argument {flag!r}{hint}"


def cmd_train(args: argparse.Namespace) -> int:
    from bigtrain.train.collector import paused_for_start
    with paused_for_start():  # the checks import torch and DeepSpeed; then this process only waits and relays lines
        return _cmd_train(args)


def _cmd_train(args: argparse.Namespace) -> int:
    checked = rank_0_here(args.hostfile)
    num_ranks = args.num_gpus or (ranks_here(args.hostfile) if args.hostfile else default_num_ranks())
    direct = one_rank_here(args, num_ranks)
    # one rank started directly checks its files itself, first thing (run.py): the same check, imported once
    if problem := check_run_args(args.run_args, files_here=checked and not direct,
                                 world_size=launched_world_size(args, num_ranks)):
        print(f"bigtrain: {problem}", file=sys.stderr)
        return 2
    if direct:
        cmd, env = direct_command(args.run_args, args.verbose), thread_env(1)
        if args.master_port:
            env["MASTER_PORT"] = str(args.master_port)
    else:
        # One machine: a free port, so that two jobs side by side do not both take DeepSpeed's 29500.
        port = args.master_port or (None if args.hostfile else free_port())
        cmd = launcher_command(args.run_args, args.num_gpus or (None if args.hostfile else num_ranks), args.hostfile,
                               port, args.launcher_arg, args.verbose)
        env = launch_env(num_ranks, args.verbose)
        if checked:
            from bigtrain.train.precheck import CHECKED_ENV
            env[CHECKED_ENV] = "1"  # the ranks need not look again before their process group
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    # a session of its own, whose ranks get SIGTERM/SIGINT from us (`bigtrain.launch.signals`), so every rank saves
    piped = None if args.verbose else subprocess.PIPE
    child = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=piped, stderr=piped)
    from bigtrain.train.collector import settle
    settle()  # the start is over: waiting and relaying lines for the job's whole life, with the collector on
    consoles = [] if args.verbose else [copy_filtered(child.stdout, sys.stdout),
                                        copy_filtered(child.stderr, sys.stderr)]

    forwarded: list[int] = []

    def forward(signum: int, frame: object) -> None:
        forwarded.append(signum)
        pass_signal(child.pid, signum)

    # restored after the launch: a caller in the same process (a notebook, a test) keeps its own handlers
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = child.wait()
        wait_for_session(child.pid)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for console in consoles:
        console.join(timeout=10)  # the launcher's last lines; a rank left holding a pipe does not hold us
    return exit_code(code, forwarded)


def one_rank_here(args: argparse.Namespace, num_ranks: int) -> bool:
    """One rank on this machine, nothing asked of the deepspeed launcher: the rank is started without it."""
    return args.hostfile is None and num_ranks == 1 and not args.launcher_arg


def direct_command(run_args: list[str], verbose: bool = False) -> list[str]:
    """`python -m bigtrain.run RUN_ARGS`: a world of one (bigtrain.distributed.rendezvous.single_process_env) needs no
    launcher, whose two processes each import DeepSpeed and torch before the rank starts to (about 6 CPU seconds
    of a one-rank job's start, docs/benchmarks.md); the rank's output, exit code and signals are the launcher's
    rank's."""
    return [sys.executable, "-m", RUN_MODULE, *run_args, *(["--verbose"] if verbose and "--verbose" not in run_args
                                                          else [])]


def exit_code(launcher: int, forwarded: list[int]) -> int:
    """The shell's 128 + N for a job stopped by signal N (143 after SIGTERM, which a scheduler reads as stopped and
    resumable), whether the ranks saved and ended cleanly or the launcher died of it (sys.exit(-15) would say 241);
    else the launcher's own code."""
    if launcher < 0:
        return 128 - launcher
    return 128 + forwarded[0] if forwarded and launcher == 0 else launcher


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="launch bigtrain.run through the deepspeed launcher",
                       description="Everything after the launcher options goes to bigtrain.run "
                                   "(e.g. --model gpt2 --size small --steps 1000 --set zero.stage=3).")
    p.add_argument("--num-gpus", type=int, default=None,
                   help="ranks on this machine (default: GPUs, or 2 on CPU); with --hostfile, ranks per node")
    p.add_argument("--hostfile", default=None, help="multi-node hostfile (see hostfile.example)")
    p.add_argument("--master-port", type=int, default=None,
                   help="rendezvous port (default: a free one on one machine, DeepSpeed's 29500 with --hostfile)")
    p.add_argument("--launcher-arg", action="append", default=[],
                   help="extra argument for the deepspeed launcher, e.g. --launcher-arg=--bind_cores_to_rank")
    p.add_argument("--verbose", action="store_true",
                   help="also print the launcher's and DeepSpeed's own lines and torch's warnings")
    p.set_defaults(run_args=[], passes_unknown_args=True)  # everything else goes to bigtrain.run
    p.set_defaults(func=cmd_train)
