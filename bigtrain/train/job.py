"""One training job end to end: config -> data -> model -> engine -> (resume) -> loop -> summary."""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bigtrain.checkpoint import store as checkpoint
from bigtrain.checkpoint.claim import claim_run_dir
from bigtrain.checkpoint.resume import check_same_model
from bigtrain.checkpoint.state import CheckpointState, ModelBuild

from deepspeed.accelerator import get_accelerator

from bigtrain import models
from bigtrain.models.registry import slow_vocab_hint
from bigtrain.config.run_config import RunConfig
from bigtrain.config.load import to_dict
from bigtrain.distributed.device import fix_cuda_arch_list
from bigtrain.distributed.lifeline import Lifeline
from bigtrain.distributed.peers import PeerWatch
from bigtrain.distributed.world import (World, collective_timeout_s, init_distributed, return_freed_memory,
                                        shutdown)
from bigtrain.ds.lint import LintError
from bigtrain.ds.resolve import resolve
from bigtrain.train import autobatch
from bigtrain.train.engine import Engine, EngineOptions
from bigtrain.train.inputs import TrainingData, build_training_data, model_overrides
from bigtrain.train.report import Reporter, write_summary
from bigtrain.train.engine import start_schedule
from bigtrain.train.loop import Diverged, LoopResult, LoopSettings, train_loop
from bigtrain.metrics.logs import attach_log_file
from bigtrain.metrics.plot import write_loss_plot
from bigtrain.checkpoint.universal import ResumePlan, Shape, plan_resume, restore_rng, universal_ds_config

log = logging.getLogger("bigtrain")
PACKAGE_DIR = Path(__file__).resolve().parents[1]


def run_job(run: RunConfig, ds_config_path: str | None = None, resume: bool = False,
            stop_after: int | None = None, trust_checkpoint: bool = False,
            sources: dict[str, str] | None = None, overwrite: bool = False) -> int:
    """Exit code: 0 done, 2 a user's mistake (one line on stderr, from rank 0 only, whichever rank saw it),
    3 a diverging run (one line naming the step and the last good checkpoint). Any other exception on a
    multi-rank job ends this rank with exit 1 and a line naming the dead peer, or this rank if it is the origin.
    `overwrite` (--overwrite) deletes an earlier run's checkpoints in the output folder first.
    `trust_checkpoint` (--trust-checkpoint) lets --resume unpickle any type (bigtrain.checkpoint.safe_load).
    `sources`: the run-config fields the user gave, and where (`config.load.field_sources`), for the
    precedence between them and a DeepSpeed JSON. Never hangs: SIGTERM/SIGINT or the launcher's death
    stop the job within a bound, and so does an end-of-run step that waits too long (`Lifeline`)."""
    world = init_distributed()
    setup_logging(world)
    lifeline = Lifeline.start(world.rank)
    watch = PeerWatch.start(world)  # a dead peer ends this rank with a line naming it, never a hang
    if world.is_main and world.size > 1:
        log.info("%s", watch.describe())
    try:
        train(run, world, ds_config_path, resume, stop_after, trust_checkpoint, sources, lifeline, overwrite)
    except Diverged as err:
        return watch.stop_job(str(err), Diverged.code)
    except (LintError, ValueError) as err:
        if not users_mistake(err):
            if world.size > 1:
                watch.fail(err)
            raise
        return watch.stop_job(str(err), 2)
    except Exception as err:  # noqa: BLE001 -- a peer died, or this rank failed: name it and exit 1
        if world.size > 1:
            watch.fail(err)
        raise
    watch.leave()  # before the last barrier: a peer past it may exit at once
    with lifeline.bound("the last barrier before exit", end_of_run_bound_s(), "every rank to finish its run"):
        shutdown()
    lifeline.close()
    return 0


def end_of_run_bound_s() -> float:
    """How long an end-of-run step may take: the collective timeout, plus a minute for the work itself."""
    return collective_timeout_s() + 60.0


def offloads_to_host(ds_config: dict) -> bool:
    zero = ds_config.get("zero_optimization", {})
    return any(zero.get(key, {}).get("device") in ("cpu", "nvme") for key in ("offload_optimizer", "offload_param"))


def users_mistake(err: Exception) -> bool:
    """A lint error, or a ValueError bigtrain raised about the user's config or data (deterministic: every
    rank raises the same, and one line says what to change). A ValueError from inside a library is a
    failure whose traceback the user needs."""
    if isinstance(err, LintError):
        return True
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(PACKAGE_DIR)


def train(run: RunConfig, world: World, ds_config_path: str | None, resume: bool, stop_after: int | None,
          trust_checkpoint: bool = False, sources: dict[str, str] | None = None,
          lifeline: Lifeline | None = None, overwrite: bool = False) -> dict:
    """One job on an initialised process group; returns the summary (Diverged after writing it, when the
    run diverged). The output folder is this job's alone while it runs (`claim_run_dir`). Without a
    `lifeline` (tests running several jobs in one process) it makes its own for this job."""
    own = lifeline is None
    lifeline = lifeline or Lifeline.start(world.rank)
    out = Path(run.train.out_dir)
    lock = claim_run_dir(out, Path(run.checkpoint.dir or out / "checkpoints"), world, resume=resume,
                         overwrite=overwrite)
    try:
        return _train(run, world, ds_config_path, resume, stop_after, trust_checkpoint, sources, lifeline)
    finally:
        lock.release()
        if own:
            lifeline.close()


def _train(run: RunConfig, world: World, ds_config_path: str | None, resume: bool, stop_after: int | None,
           trust_checkpoint: bool, sources: dict[str, str] | None, lifeline: Lifeline) -> dict:
    out = Path(run.train.out_dir)
    run, auto_micro = autobatch.defer_auto(run)  # batch.micro_batch=auto: probed before the engine is built
    open_run_log(out, world)
    ckpt_dir = Path(run.checkpoint.dir or out / "checkpoints")
    found = find_checkpoint(ckpt_dir, world) if resume else None
    run, ds_config = resolve_ds_config(run, ds_config_path, world, sources,
                                       resume_batch=found[1].ds_config.get("train_batch_size") if found else None)
    seed_everything(run.train.seed)
    data = build_training_data(run.data, run.model, out, world, run.train.seed)
    if world.is_main:
        log.info("data: %s", data.bundle.description)
    model_build = ModelBuild(run.model.family, run.model.size, model_overrides(run.model, data, run.data.seq_len))
    if found:
        check_same_model(ckpt_dir / found[0], found[1], model_build)
    # Before the engine: loading a checkpoint saved at another shape switches DeepSpeed's config.
    plan = plan_resume(ckpt_dir, found, Shape.of_job(world.size, ds_config, run.pipeline.stages), world,
                       None, trust_checkpoint) if found else None
    spec = build_model(model_build, world)
    options = engine_options(run)
    if auto_micro:
        run, ds_config = autobatch.apply_probe(run, spec, ds_config, options, data, world)
        seed_everything(run.train.seed)  # the probe's steps drew from the RNG
    # The universal-load switch tells DeepSpeed how to load this once; the config recorded is the one trained with.
    engine = Engine(spec, universal_ds_config(ds_config) if plan and plan.universal else ds_config, options)
    data.set_data_parallel(engine.dp_rank, engine.dp_size)
    saved = resume_from(engine, plan, world, data, run.train.seed, trust_checkpoint) if plan else None
    if world.is_main:
        log.info("model %s/%s: %.2fM parameters; %s", spec.family, spec.size, spec.num_params / 1e6,
                 _batch_line(ds_config, engine, world))
    reporter = Reporter(run, spec, ds_config, engine, world, out, prior_losses=saved.losses if saved else None)
    settings = loop_settings(run, ckpt_dir, stop_after, resumed_from=plan.ckpt_dir / plan.tag if plan else None)
    result = train_loop(engine, world=world, settings=settings, data=data,
                        record=RunRecord(run, ds_config, world, data, model_build.to_json()), reporter=reporter,
                        start_step=saved.step if saved else 0, stop=lifeline)
    summary = finish(run, ds_config, world, out, reporter, result, lifeline)
    if result.diverged:
        raise Diverged(diverged_line(result))
    if not result.stopped_by and run.train.sample_tokens and data.tokenizer is not None:
        from bigtrain.train.sample import print_sample
        with lifeline.bound("the end-of-run sample", end_of_run_bound_s(),
                            "every rank to run the sample's forward passes"):
            print_sample(engine, data.tokenizer, run.train.sample_tokens, world)
    return summary


def open_run_log(out: Path, world: World) -> None:
    """DeepSpeed's log and the warnings (held since start-up) go to OUT/logs/rank{R}.log."""
    log_file = attach_log_file(out, world.rank)
    if world.is_main:
        log.info("log: %s (DeepSpeed's messages and warnings; --verbose prints them here)", log_file.parent)
    arch_note = fix_cuda_arch_list()  # for ranks not started by `bigtrain train`
    if arch_note and world.is_main:
        log.warning("%s", arch_note)


def resolve_ds_config(run: RunConfig, ds_config_path: str | None, world: World, sources: dict[str, str] | None,
                      resume_batch: int | None) -> tuple[RunConfig, dict]:
    """The DeepSpeed config this job trains with (`bigtrain.ds.resolve`), its notes logged; a resumed job
    keeps the checkpoint's global batch."""
    resolved = resolve(run, ds_config_path, world.size, sources=sources, out_dir=str(Path(run.train.out_dir)),
                       resume_batch=resume_batch)
    if world.is_main:
        for note in resolved.notes:
            log.info("%s", note)
    if offloads_to_host(resolved.ds_config) and return_freed_memory() and world.is_main:
        log.info("offload: malloc returns freed memory to the system (more fits; BIGTRAIN_MALLOC_TUNING=1 keeps it)")
    return resolved.run, resolved.ds_config


def find_checkpoint(ckpt_dir: Path, world: World) -> tuple[str, CheckpointState]:
    """The newest complete, undamaged checkpoint to resume from (a collective: the ranks check its bytes)."""
    found = checkpoint.find_resumable(ckpt_dir, world)
    if found is None:
        raise ValueError(f"--resume: no complete checkpoint in {ckpt_dir}; drop --resume to start fresh")
    return found


def build_model(model_build: ModelBuild, world: World) -> models.ModelSpec:
    """The model `model_build` describes (it is recorded in every checkpoint for resume and export)."""
    spec = models.build(model_build.family, model_build.size, **model_build.overrides)
    if world.is_main and (hint := slow_vocab_hint(spec, get_accelerator().device_name())):
        log.warning("%s", hint)
    if world.is_main and spec.extra.get("weights_note"):  # a config-only Hugging Face directory
        log.info("%s", spec.extra["weights_note"])
    return spec


def diverged_line(result: LoopResult) -> str:
    """One line: where the run diverged, that nothing was saved from it, and where to go on from."""
    aside = (f"; {result.set_aside.name.removesuffix('_diverged')}, whose weights gave that loss, was set aside as "
             f"{result.set_aside}" if result.set_aside else "")
    if result.last_checkpoint is not None:
        after = (f"the last complete checkpoint is {result.last_checkpoint} (resume from it with --resume and a "
                 "lower optimizer.lr)")
    else:
        after = "no checkpoint was saved before it: start again with a lower optimizer.lr"
    return f"the run diverged at {result.diverged}; nothing was saved from it{aside}; {after}"


def engine_options(run: RunConfig) -> EngineOptions:
    return EngineOptions(
        pipeline_stages=run.pipeline.stages, partition_method=run.pipeline.partition_method,
        activation_checkpointing=run.activation_checkpointing.enabled,
        checkpoint_every_n_layers=run.activation_checkpointing.every_n_layers, seed=run.train.seed,
        compile=run.train.compile, loss_impl=run.train.loss_impl)


def loop_settings(run: RunConfig, ckpt_dir: Path, stop_after: int | None,
                  resumed_from: Path | None = None) -> LoopSettings:
    return LoopSettings(steps=run.train.steps, eval_interval=run.train.eval_interval,
                        eval_batches=run.train.eval_batches, ckpt_dir=ckpt_dir, ckpt_interval=run.checkpoint.interval,
                        keep_last=run.checkpoint.keep_last, stop_after=stop_after, max_loss=run.train.max_loss,
                        resumed_from=resumed_from)


def finish(run: RunConfig, ds_config: dict, world: World, out: Path, reporter: Reporter, result: LoopResult,
           lifeline: Lifeline) -> dict:
    """The run's summary (every rank's memory figures: an all-gather), written with its loss plot by rank 0."""
    with lifeline.bound("the run summary", end_of_run_bound_s(), "every rank's memory figures (an all-gather)"):
        summary = reporter.summary(result, run_config=to_dict(run), ds_config=ds_config)
    if world.is_main:
        log.info("wrote %s", write_summary(out, summary))
        write_loss_plot(summary, out / "loss.png")
    return summary


def resume_from(engine: Engine, plan: ResumePlan, world: World, data: TrainingData, seed: int,
                trust: bool = False) -> CheckpointState:
    """Load the planned checkpoint (universal when the shape changed); returns its saved state.

    The state (step, losses, data position) comes from the bigtrain.json marker of the
    checkpoint found; the sampler continues the same global sample order at another
    data-parallel size.
    """
    checkpoint.load(engine.ds, plan.ckpt_dir, plan.load_tag, trust=trust)
    start_schedule(engine.scheduler)  # the restored iteration's rate (universal checkpoints do not hold it)
    rng = restore_rng(plan, world.rank, seed, trust)
    data.load_state_dict(plan.state.data)
    if world.is_main:
        log.info("resumed from %s at step %d (RNG %s)", plan.ckpt_dir / plan.load_tag, plan.state.step, rng)
    return plan.state


@dataclass(frozen=True)
class RunRecord:
    """What every checkpoint of this run records beside DeepSpeed's files: the data position, the loss
    history, and how to rebuild the model (resume and export read them)."""

    run: RunConfig
    ds_config: dict
    world: World
    data: TrainingData
    model_build: dict  # ModelBuild.to_json()

    def state_at(self, step: int, losses: list[float]) -> CheckpointState:
        data = self.data
        tokenizer = data.tokenizer_dir.resolve() if data.tokenizer_dir else None
        return CheckpointState(step=step, world_size=self.world.size, pipeline_stages=self.run.pipeline.stages,
                               data=data.state_dict(), losses=list(losses), model_build=ModelBuild(**self.model_build),
                               run_config=to_dict(self.run), ds_config=self.ds_config,
                               run_dir=Path(self.run.train.out_dir).resolve(), tokenizer_dir=tokenizer)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def setup_logging(world: World) -> None:
    from bigtrain.metrics.logs import setup_console
    setup_console(world.rank, world.is_main)  # rank 0's INFO and every rank's warnings on the console


def _batch_line(ds_config: dict, engine: Engine, world: World) -> str:
    return (f"world size {world.size}, data-parallel {engine.dp_size}: train_batch_size "
            f"{ds_config['train_batch_size']} = micro {ds_config['train_micro_batch_size_per_gpu']} x accum "
            f"{ds_config['gradient_accumulation_steps']} x dp {engine.dp_size}")
