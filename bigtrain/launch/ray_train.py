"""`bigtrain ray-train`: bigtrain's job on a Ray cluster, through Ray Train's TorchTrainer.

Ray starts one worker per rank and their process group (gloo on CPU, NCCL on GPUs); each worker
then runs bigtrain's normal job, as a rank started by the deepspeed launcher would: DeepSpeed joins
the process group Ray made, the run config decides ZeRO stage, batch and checkpoints, rank 0 writes
summary.json. Two things are added: metrics go to Ray each log step (`ray.train.report`), and every
bigtrain checkpoint is registered with Ray as a small pointer directory, so that when a worker dies
Ray's FailureConfig restarts the whole group and the workers continue from bigtrain's last
complete checkpoint through the same path as `--resume`.

Ray is an optional extra: nothing here imports it at module level.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

RAY_MISSING = "Ray is not installed; install it with: pip install 'bigtrain[ray]'  (or: pip install 'ray[train,tune]')"
POINTER = "bigtrain_checkpoint.json"  # the file in a Ray checkpoint: where bigtrain's checkpoint is
# Test-only: "RANK:STEP" makes that rank exit abruptly after that step, on an attempt that did not
# start from a Ray checkpoint (so the restarted attempt runs through). Used by tests/test_ray.py.
TEST_EXIT_ENV = "BIGTRAIN_RAY_TEST_EXIT_AT"


def require_ray() -> None:
    """A clear one-line error (ValueError, so the CLI prints it) when Ray is not installed."""
    try:
        import ray  # noqa: F401
        import ray.train  # noqa: F401
    except ImportError:
        raise ValueError(RAY_MISSING) from None


def connect(address: str | None, num_cpus: int, object_store_mb: int = 256) -> bool:
    """Join the cluster at `address`, or start a local one; returns whether this call started Ray.

    A local cluster gets `num_cpus` logical CPUs (at least the workers' request, so they are never
    left waiting for cores), no dashboard and a small object store: bigtrain moves no data through it.
    """
    import ray
    if ray.is_initialized():
        return False
    # Ray's own loggers at ERROR in every process of this job: without a dashboard (the state API), Ray
    # Train's placement-group cleaner would warn every second that it cannot query the controller.
    quiet = {"logging_level": logging.WARNING, "logging_config": ray.LoggingConfig(log_level="ERROR")}
    ours = logging.getLogger("bigtrain")
    level = ours.getEffectiveLevel()
    if address:
        ray.init(address=address, **quiet)
    else:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                 object_store_memory=object_store_mb * 2**20, **quiet)
    if ours.level == logging.NOTSET:  # Ray's config also sets this process's root logger to ERROR: bigtrain's
        ours.setLevel(level)          # warnings on the driver (and a caller's own lines through it) stay
    return True


@dataclass
class RayTrainOptions:
    """How Ray runs the job; the job itself is described by run.py's flags."""
    num_workers: int = 2
    use_gpu: bool = False
    cpus_per_worker: int = 1
    address: str | None = None  # None: start a local Ray cluster
    storage_path: str | None = None  # Ray's run storage; default OUT/ray. Shared by all nodes on a cluster.
    name: str | None = None  # the Ray run's name; the same name and storage continue a Ray run
    max_failures: int = 0  # restarts after a worker failure, each from the last complete checkpoint
    env: dict[str, str] = field(default_factory=dict)  # extra environment variables for the workers


def train_on_ray(run_args: list[str], options: RayTrainOptions | None = None, **kwargs: Any) -> Any:
    """Run `bigtrain/run.py RUN_ARGS` on Ray workers; returns Ray Train's `Result`.

    The run config is loaded and linted here, on the driver, at the workers' world size, so a
    mistake is one line before any worker starts. Relative paths in RUN_ARGS resolve against the
    current directory on every worker (a shared filesystem on a multi-node cluster, as for a
    multi-node deepspeed job); OUT must be shared too, since resume reads every rank's files.
    Example: `train_on_ray(["--model", "gpt2", "--size", "small", "--steps", "1000"], num_workers=8, use_gpu=True)`.
    """
    opts = options or RayTrainOptions(**kwargs)
    if opts.num_workers < 1:
        raise ValueError(f"--num-workers is {opts.num_workers}; give 1 or more")
    out = check_run_args(run_args, opts.num_workers, opts.use_gpu)  # a mistake is one line, with Ray or without
    require_ray()
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    started = connect(opts.address, max(os.cpu_count() or 1, opts.num_workers * opts.cpus_per_worker))
    storage = Path(opts.storage_path or out / "ray")
    storage = storage if "://" in str(storage) else storage.resolve()
    trainer = TorchTrainer(
        train_loop_per_worker=worker_main,
        train_loop_config={"run_args": list(run_args), "cwd": os.getcwd(), "env": dict(opts.env),
                           "tune_cpu": not opts.use_gpu},
        scaling_config=ray.train.ScalingConfig(num_workers=opts.num_workers, use_gpu=opts.use_gpu,
                                               resources_per_worker={"CPU": opts.cpus_per_worker}),
        # the collective timeout of a launcher job (DEEPSPEED_TIMEOUT minutes): a dead peer ends it, not a hang
        torch_config=TorchConfig(timeout_s=int(float(os.environ.get("DEEPSPEED_TIMEOUT", "10")) * 60)),
        run_config=ray.train.RunConfig(
            name=opts.name or f"bigtrain_{time.strftime('%Y%m%d_%H%M%S')}", storage_path=str(storage),
            failure_config=ray.train.FailureConfig(max_failures=opts.max_failures)))
    try:
        return trainer.fit()
    finally:
        if started:
            ray.shutdown()


def check_run_args(run_args: list[str], world_size: int, use_gpu: bool) -> Path:
    """Parse and lint the job's flags as run.py will; returns the run's OUT directory."""
    from bigtrain.ds.lint import DeviceCaps
    from bigtrain.ds.resolve import resolve
    from bigtrain.config.flags import build_run_parser, run_config_from_args
    args = parse_run_args(build_run_parser(), run_args)
    run = run_config_from_args(args)
    # The workers' device decides what precision they can run; assume a modern GPU when they have one.
    device = DeviceCaps("cuda", fp16=True, bf16=True) if use_gpu else DeviceCaps.detect()
    if run.precision == "auto" and not use_gpu:
        from dataclasses import replace
        from bigtrain.distributed.device import default_precision
        run = replace(run, precision=default_precision())
    resolve(run, args.deepspeed_config, world_size, device)  # raises LintError / ValueError
    return Path(run.train.out_dir)


def parse_run_args(parser: argparse.ArgumentParser, run_args: list[str]) -> argparse.Namespace:
    """run.py's parser, with a ValueError (one line from the CLI) instead of argparse's exit."""
    def error(message: str) -> None:
        raise ValueError(f"{message} (the job's flags are run.py's: python bigtrain/run.py --help)")
    parser.error = error  # type: ignore[method-assign]
    return parser.parse_args(run_args)


# --- In each Ray worker ----------------------------------------------------------------------------

def worker_main(config: dict) -> None:
    """Ray Train's per-worker function: bigtrain's job, resumed from Ray's checkpoint after a restart."""
    from bigtrain.train.collector import paused_for_start
    with paused_for_start():  # until the first step, as a launcher's rank (bigtrain/run.py)
        _worker_job(config)


def _worker_job(config: dict) -> None:
    import ray.train
    from bigtrain.config.flags import build_run_parser, run_config_from_args
    from bigtrain.train.job import train
    from bigtrain.train.process import JobProcess
    from bigtrain.train.report import add_listener
    if os.path.isdir(config["cwd"]):
        os.chdir(config["cwd"])
    os.environ.update(config["env"])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if config["tune_cpu"]:
        from bigtrain.distributed.host import tune_cpu_rank
        tune_cpu_rank()  # cores and malloc as a launcher rank gets them (Ray set LOCAL_RANK/LOCAL_WORLD_SIZE)
    quiet_report_lines()
    run_args = list(config["run_args"])
    restored = ray.train.get_checkpoint()
    resume_tag = read_pointer(restored) if restored is not None else None
    args = build_run_parser().parse_args(run_args)
    if resume_tag is not None:
        # Ray restarted the group: continue from bigtrain's newest complete checkpoint in that directory
        # (the registered one, or a later one saved just before the failure), as --resume does.
        args.set = [*args.set, f"checkpoint.dir={resume_tag.parent}"]
        args.resume, args.overwrite = True, False
    run = run_config_from_args(args)
    rank = ray.train.get_context().get_world_rank()
    bridge = RayReporter(rank, _test_exit_step(rank) if resume_tag is None else None, Path(run.train.out_dir))
    remove = add_listener(bridge)
    try:
        with JobProcess.start() as job:
            train(run, job.world, args.deepspeed_config, args.resume, args.stop_after, overwrite=args.overwrite,
                  lifeline=job.lifeline)
        code = job.code
    finally:
        remove()
    if code != 0:
        raise RuntimeError(f"bigtrain's job on rank {rank} ended with exit code {code} (its log says why)")


class _NoReportEcho(logging.Filter):
    """Ray Train echoes every report on the console ("Reporting training result 7: TrainingReport(...)"),
    a long line per log step next to bigtrain's own."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(("Reporting training result", "Checkpoint successfully created"))


def quiet_report_lines() -> None:
    """Filter at the loggers that emit them, whichever handlers (Ray's or bigtrain's) print them.
    They are Ray internals (one is named after its file): if they move, the lines just come back."""
    try:
        from ray.train.v2._internal.execution import context, storage
    except ImportError:
        return
    for module in (context, storage):
        if isinstance(getattr(module, "logger", None), logging.Logger):
            module.logger.addFilter(_NoReportEcho())


def read_pointer(checkpoint: Any) -> Path:
    """The bigtrain checkpoint (CKPT_DIR/step_N) that a Ray checkpoint points to."""
    with checkpoint.as_directory() as directory:
        pointer = json.loads((Path(directory) / POINTER).read_text())
    return Path(pointer["path"])


def _test_exit_step(rank: int) -> int | None:
    spec = os.environ.get(TEST_EXIT_ENV, "")
    if ":" not in spec:
        return None
    who, step = spec.split(":", 1)
    return int(step) if int(who) == rank else None


class RayReporter:
    """A bigtrain report listener that forwards to Ray Train. Every rank calls `ray.train.report` at
    the same steps (Ray requires it: each call is a barrier); Ray keeps rank 0's metrics and its
    checkpoint, a pointer to bigtrain's checkpoint directory, which must be on shared storage."""

    def __init__(self, rank: int, exit_at: int | None = None, out: Path | None = None):
        self.rank, self.exit_at, self.out = rank, exit_at, out
        self.last: dict[str, float] = {}

    def __call__(self, event: str, step: int, values: dict) -> None:
        import ray.train
        if event == "log":
            self.last = {k: float(v) for k, v in values.items() if isinstance(v, (int, float))}
            ray.train.report({"step": step, **self.last})
            if self.exit_at is not None and step >= self.exit_at:
                self._test_exit(step)
        elif event == "eval":
            ray.train.report({"step": step, **self.last, **values})
        elif event == "checkpoint":
            self._report_checkpoint(step, Path(values["path"]).resolve())

    def _test_exit(self, step: int) -> None:
        """Die as a crashed or preempted worker does (no clean-up), leaving a note for the test."""
        if self.out is not None:
            (self.out / f"test_exit_rank{self.rank}_step{step}").touch()
        print(f"bigtrain: rank {self.rank} exits at step {step} ({TEST_EXIT_ENV})", file=sys.stderr, flush=True)
        os._exit(1)

    def _report_checkpoint(self, step: int, tag_dir: Path) -> None:
        import ray.train
        metrics = {"step": step, **self.last, "bigtrain_checkpoint": str(tag_dir)}
        if self.rank != 0:
            ray.train.report(metrics, checkpoint=None, checkpoint_dir_name=f"checkpoint_{tag_dir.name}")
            return
        with tempfile.TemporaryDirectory(prefix="bigtrain_ray_ckpt_") as tmp:
            (Path(tmp) / POINTER).write_text(json.dumps({"path": str(tag_dir), "step": step}))
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp),
                             checkpoint_dir_name=f"checkpoint_{tag_dir.name}")


# --- CLI ---------------------------------------------------------------------------------------------

def cmd_ray_train(args: argparse.Namespace) -> int:
    opts = RayTrainOptions(num_workers=args.num_workers, use_gpu=args.use_gpu, cpus_per_worker=args.cpus_per_worker,
                           address=args.address, storage_path=args.storage_path, name=args.name,
                           max_failures=args.max_failures)
    try:
        result = train_on_ray(args.run_args, opts)
    except ValueError:
        raise  # the job config's mistake, or Ray missing: one line from the CLI
    except Exception as err:
        import ray.train  # installed: train_on_ray got past require_ray
        if not isinstance(err, ray.train.TrainingFailedError):
            raise
        print(f"bigtrain ray-train: the run failed ({failure_line(err, opts.max_failures)}); "
              "the workers' log lines above say why", file=sys.stderr)
        return 1
    return report_result(result, sys.stdout.write)


def failure_line(err: Exception, max_failures: int) -> str:
    """`rank R: first line of its error` for each failed worker (Ray's message is a page of snippets)."""
    failures = getattr(err, "worker_failures", None) or {}
    parts = [f"rank {rank}: {_first_line(e)}" for rank, e in sorted(failures.items())] or [_first_line(err)]
    restarts = f" after {max_failures} restart{'s' if max_failures != 1 else ''}" if max_failures else ""
    return "; ".join(parts)[:400] + restarts


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def report_result(result: Any, write: Callable[[str], Any]) -> int:
    """One line on how the run ended; exit 1 when Ray gave up on it."""
    if result.error is not None:
        print(f"bigtrain ray-train: the run failed: {_first_line(result.error)[:300]} (Ray run at {result.path})",
              file=sys.stderr)
        return 1
    metrics = result.metrics or {}
    loss = f"loss {metrics['loss']:.4f} at step {metrics.get('step')}; " if "loss" in metrics else ""
    write(f"ray-train: done; {loss}Ray run at {result.path}\n")
    return 0


def add_ray_train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ray-train", help="run bigtrain/run.py on a Ray cluster through Ray Train (needs bigtrain[ray])",
                       description="Everything after the Ray options goes to bigtrain/run.py "
                                   "(e.g. --model gpt2 --size small --steps 1000 --set zero.stage=2).")
    p.add_argument("--num-workers", type=int, default=2, help="Ray Train workers, one rank each (default 2)")
    p.add_argument("--use-gpu", action="store_true", help="one GPU per worker (NCCL); default CPU workers (gloo)")
    p.add_argument("--cpus-per-worker", type=int, default=1, help="CPUs Ray reserves per worker (default 1)")
    p.add_argument("--address", default=None, help="Ray cluster to join (auto, or HEAD_IP:6379); "
                                                    "default: start a local Ray cluster")
    p.add_argument("--storage-path", default=None, help="Ray's run storage, shared by every node "
                                                         "(NFS path or s3://...); default OUT/ray")
    p.add_argument("--name", default=None, help="Ray run name (default bigtrain_TIMESTAMP)")
    p.add_argument("--max-failures", type=int, default=0,
                   help="restart after a worker failure up to K times, from bigtrain's last complete checkpoint")
    p.set_defaults(run_args=[], passes_unknown_args=True, func=cmd_ray_train)
