"""One training job, top to bottom: config -> data -> model -> engine -> resume -> loop -> summary.

`train` is the whole spine; `bigtrain/run.py` calls it inside a `JobProcess` (process group, console, exit
code), and test harnesses call it for several jobs in one process. The steps it names are below it, in order.
"""
from __future__ import annotations

import contextlib
import logging
import random
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from deepspeed.accelerator import get_accelerator

from bigtrain import models, objectives
from bigtrain.checkpoint import store as checkpoint
from bigtrain.checkpoint.claim import claim_run_dir, nothing_to_resume_line
from bigtrain.checkpoint.resume import (ResumePlan, Shape, check_same_model, check_same_objective, plan_resume,
                                        restore_rng)
from bigtrain.checkpoint.state import CheckpointState, ModelBuild
from bigtrain.config import provenance
from bigtrain.config.load import to_dict
from bigtrain.config.run_config import RunConfig
from bigtrain.distributed.device import fix_cuda_arch_list
from bigtrain.distributed.lifeline import Lifeline
from bigtrain.distributed.op_builds import build_lines, optimizer_op
from bigtrain.distributed.world import World
from bigtrain.ds.groups import group_problem
from bigtrain.ds.keys import SCHEDULE_KINDS
from bigtrain.ds.resolve import Resolved
from bigtrain.eval.during_training import TaskEvaluator
from bigtrain.metrics.logs import attach_log_file
from bigtrain.metrics.plot import write_loss_plot
from bigtrain.models.registry import slow_vocab_hint
from bigtrain.parallel.split_rules import check_split_layout
from bigtrain.config.topology import Topology
from bigtrain.parallel.lora import check_same_lora, training_flops
from bigtrain.train import autobatch
from bigtrain.train.collector import keep_libraries, settle as settle_collector
from bigtrain.train.engine import Engine, EngineOptions, start_schedule
from bigtrain.train.job_config import JobConfig
from bigtrain.train.inputs import (TrainingData, build_training_data, local_models, overrides_for_run,
                                    pads_to_longest)
from bigtrain.train.loop import Diverged, LoopResult, LoopSettings, train_loop
from bigtrain.train.process import end_of_run_bound_s
from bigtrain.train.reference_logps import attach_reference_logps
from bigtrain.train.report import Reporter, write_summary

log = logging.getLogger("bigtrain")


def train(run: RunConfig, world: World, ds_config_path: str | None = None, resume: bool = False,
          stop_after: int | None = None, *, trust_checkpoint: bool = False, sources: dict[str, str] | None = None,
          overwrite: bool = False, lifeline: Lifeline | None = None) -> dict:
    """One job on an initialised process group; returns the summary (raises Diverged after writing it).

    The output folder is this job's alone while it runs (`claim_run_dir`). `sources`: the run-config fields
    the user gave, and where (`config.load.field_sources`), for the precedence against a DeepSpeed JSON.
    `trust_checkpoint` (--trust-checkpoint) lets --resume unpickle any type. Without a `lifeline` (several
    jobs in one process) the job makes its own."""
    out = Path(run.train.out_dir)
    ckpt_dir = Path(run.checkpoint.dir or out / "checkpoints")
    with contextlib.ExitStack() as stack:
        lifeline = lifeline or stack.enter_context(contextlib.closing(Lifeline.start(world.rank)))
        stack.callback(claim_run_dir(out, ckpt_dir, world, resume=resume, overwrite=overwrite).release)
        open_run_log(out, world)
        config, resolved = resolve_job(run, world, ds_config_path, sources, ckpt_dir if resume else None)
        run = config.run
        # Hub names downloaded once per node (the checkpoint's commit on resume); the run config keeps the names
        here, hub = local_models(run, world, config.found[1].model_build if config.found else None)
        data = load_data(here, out, world)
        keep_libraries()  # the model's family was imported with its data
        model_build = describe_model(config, data, ckpt_dir, here, hub.get("model"))
        plan = plan_resume(ckpt_dir, config.found, Shape.of_job(world.size, resolved.ds_config,
                                                                resolved.run.pipeline.stages),
                           world, trust_checkpoint) if config.found else None
        spec = build_model(model_build, world)
        task_eval = TaskEvaluator.start(run, spec, data.tokenizer, world.rank, world.size)  # before the engine
        engine, resolved = build_engine(config, resolved, spec, data, model_build, plan)
        saved = resume_from(engine, plan, world, data, run.train.seed, trust_checkpoint) if plan else None
        spec = say_what_trains(config, resolved, spec, engine, saved)
        reporter = Reporter(resolved.run, spec, resolved.ds_config, engine, world, out, prior=saved)
        record = RunRecord(resolved.run, resolved.recorded, world, data, model_build.to_json())
        settle_collector()
        result = train_loop(engine, world=world, data=data, record=record, reporter=reporter, stop=lifeline,
                            settings=loop_settings(resolved.run, ckpt_dir, stop_after, plan),
                            start_step=saved.step if saved else 0, task_eval=task_eval)
        summary = finish(resolved, world, out, reporter, result, lifeline, data.bundle.stats, hub)
        if result.diverged:
            raise Diverged(diverged_line(result))
        if not result.stopped_by:
            end_of_run_sample(engine, data, run, world, lifeline)
        return summary


def resolve_job(run: RunConfig, world: World, ds_config_path: str | None, sources: dict[str, str] | None,
                ckpt_dir: Path | None) -> tuple[JobConfig, Resolved]:
    """The job's config and its first DeepSpeed dict (which comes from `resolve` alone, here and after the
    micro-batch probe); with `ckpt_dir` (--resume) the checkpoint to resume from, whose rate, weight decay and
    schedule the job keeps where the user gives none again (`provenance.keep_recorded`). Seeds every generator."""
    asked = run
    run, auto_micro = autobatch.defer_auto(run)
    found = find_checkpoint(ckpt_dir, world) if ckpt_dir else None
    kept: tuple[str, ...] = ()
    if found:  # what needs no data first: a mismatch is refused before the corpus is tokenized
        tag_dir = ckpt_dir / found[0]
        check_same_lora(tag_dir, found[1].run_config, run.lora)
        check_same_objective(tag_dir, found[1].run_config, run.objective.kind)
        run, kept = provenance.keep_recorded(run, found[1].run_config, sources)
    config = JobConfig(run, ds_config_path, world, sources, found, auto_micro, kept=kept)
    resolved = config.resolve()
    if world.is_main:  # DeepSpeed builds the optimizer's op inside the engine, saying nothing for minutes
        for line in build_lines([optimizer_op(resolved.ds_config)]):
            log.info("%s", line)
    check_split_layout(asked, Topology.of(resolved.ds_config, world.size))  # sizes a JSON gave, too
    resume_batch = found[1].ds_config.get("train_batch_size") if found else None
    if line := group_problem(run, ds_config_path, world.size, sources, resume_batch=resume_batch,
                             ds_config=resolved.ds_config):
        raise ValueError(line)  # whole groups of an online objective's completions on every rank
    seed_everything(run.train.seed)
    return config, resolved


def load_data(run: RunConfig, out: Path, world: World) -> TrainingData:
    """The run's data, of the layout its objective reads (one line if not)."""
    data = build_training_data(run.data, run.model, out, world, run.train.seed, run.objective.declared)
    data.longest = pads_to_longest(run)
    problem = objectives.data_problem(run.objective.kind, run.objective.declared, data.bundle.layout,
                                      plain_text=data.bundle.stats is None)
    if problem:
        raise ValueError(problem)
    if world.is_main:
        log.info("data: %s", data.bundle.description)
    return data


def describe_model(config: JobConfig, data: TrainingData, ckpt_dir: Path, here: RunConfig,
                   hub: dict | None) -> ModelBuild:
    """The model this job builds (recorded in every checkpoint for resume and export), the checkpoint's own when
    resuming (one line if not). `here`: the run config with its model a local directory (`local_models`); `hub`:
    the Hub commit it came from."""
    run = config.run
    model_build = ModelBuild(run.model.family, run.model.size,
                             overrides_for_run(here, data.bundle, get_accelerator().device_name()), hub)
    if config.found:
        tag, state = config.found
        check_same_model(ckpt_dir / tag, state, model_build)
    return model_build


def build_engine(config: JobConfig, resolved: Resolved, spec: models.ModelSpec, data: TrainingData,
                 model_build: ModelBuild, plan: ResumePlan | None) -> tuple[Engine, Resolved]:
    """The engine, with the probed micro-batch and the universal-load switch resolved into its dict; a precomputed
    reference's numbers attached to the data first (the copy that computes them is freed before the policy is
    built)."""
    run, world = config.run, config.world
    options = engine_options(resolved.run, token_weighted=data.bundle.stats is not None)
    micro = probe_micro_batch(spec, config, resolved, options, data, world) if config.auto_micro else None
    if micro is not None or (plan and plan.universal):
        resolved = config.resolve(micro_batch=micro, load_universal=bool(plan and plan.universal))
    objective = objectives.build_objective(run.objective, lora=run.lora.r > 0)
    if objective.reference == "precomputed":
        data.bundle.stats["reference_logps"] = attach_reference_logps(
            data.bundle, spec, resolved.ds_config, options.seed, model_build, world)
    engine = Engine(spec, resolved.ds_config, options, objective, tokenizer=data.tokenizer)
    data.set_data_parallel(engine.dp_rank, engine.dp_size)
    return engine, resolved


def say_what_trains(config: JobConfig, resolved: Resolved, spec: models.ModelSpec, engine: Engine,
                    saved: CheckpointState | None) -> models.ModelSpec:
    """The start lines (a resume's schedule change, the model and batch, LoRA, the objective), and `spec` with one
    sample's FLOPs and tokens as this job trains it: no weight gradients for a LoRA base (fewer than spec's 6N),
    the objective's rows and the frozen forward passes beside them."""
    world, objective = config.world, engine.objective
    if saved and world.is_main:
        if line := schedule_change_line(config.found[1].run_config, config.run, engine.lr(), saved.step):
            log.warning("%s", line)
    if world.is_main:
        log.info("model %s/%s: %.2fM parameters; %s", spec.family, spec.size, spec.num_params / 1e6,
                 _batch_line(resolved.ds_config, engine, world))
        log.info("%s", training_line(config, resolved))
        if engine.lora:
            log.info("%s", engine.lora.line)
    if engine.lora:
        spec = replace(spec, flops_per_sample=training_flops(spec, engine.lora))
    needs = objective.declare(objective.settings)
    rows = needs.rows_per_sample
    factor = rows * objective.flops_factor()
    if factor != 1.0 or rows != 1:
        spec = replace(spec, flops_per_sample=spec.flops_per_sample * factor,
                       tokens_per_sample=spec.tokens_per_sample * rows)
    # every rank: objective.ds3_gather_for_generation=auto asks each rank's free memory
    gather = engine.policy.choose_gather(needs.gathers_weights) if needs.generates else ""
    if world.is_main and (rows != 1 or objective.reference != "none" or gather):
        log.info("objective %s%s: %d %s per step%s", objective.kind,
                 f", reference {objective.reference}" if objective.reference != "none" else "",
                 resolved.ds_config["train_batch_size"], objective.samples, f"; {gather}" if gather else "")
    return spec


def training_line(config: JobConfig, resolved: Resolved) -> str:
    """The rate, weight decay and schedule the job trains with, each said with where it came from."""
    given = provenance.provenance(config.sources, resolved.json_fields, config.kept)
    scheduler = (resolved.ds_config.get("scheduler") or {}).get("type")
    unnamed = scheduler if scheduler is not None and scheduler not in SCHEDULE_KINDS else None
    return provenance.describe(resolved.run, given, json_schedule=unnamed)


def end_of_run_sample(engine: Engine, data: TrainingData, run: RunConfig, world: World, lifeline: Lifeline) -> None:
    """A sample from the trained model (train.sample_tokens), every rank taking part, bounded in time."""
    if not run.train.sample_tokens or data.tokenizer is None or data.bundle.processor is not None:
        return  # (a vision-language model's held-out prompt needs its images: `bigtrain generate --image` has them)
    from bigtrain.train.sample import print_sample
    with lifeline.bound("the end-of-run sample", end_of_run_bound_s(), "every rank to run the sample's forward passes"):
        print_sample(engine, data.tokenizer, run.train.sample_tokens, world, data.bundle.sample_prompt)


def open_run_log(out: Path, world: World) -> None:
    """DeepSpeed's log and the warnings (held since start-up) go to OUT/logs/rank{R}.log."""
    log_file = attach_log_file(out, world.rank)
    if world.is_main:
        log.info("log: %s (DeepSpeed's messages and warnings; --verbose prints them here)", log_file.parent)
    arch_note = fix_cuda_arch_list()  # for ranks not started by `bigtrain train`
    if arch_note and world.is_main:
        log.warning("%s", arch_note)


def find_checkpoint(ckpt_dir: Path, world: World) -> tuple[str, CheckpointState]:
    """The newest complete, undamaged checkpoint to resume from (a collective: the ranks check its bytes)."""
    found = checkpoint.find_resumable(ckpt_dir, world)
    if found is None:
        raise ValueError(nothing_to_resume_line(ckpt_dir))
    return found


def build_model(model_build: ModelBuild, world: World) -> models.ModelSpec:
    """The model `model_build` describes (it is recorded in every checkpoint for resume and export)."""
    spec = models.build(model_build.family, model_build.size, **model_build.overrides)
    if world.is_main and (hint := slow_vocab_hint(spec, get_accelerator().device_name())):
        log.warning("%s", hint)
    if world.is_main and spec.weights_note:  # a config-only Hugging Face directory
        log.info("%s", spec.weights_note)
    return spec


def engine_options(run: RunConfig, token_weighted: bool = False) -> EngineOptions:
    """`token_weighted`: the data is chat/instruction examples, whose trained tokens differ from row to row."""
    return EngineOptions(
        pipeline_stages=run.pipeline.stages, partition_method=run.pipeline.partition_method,
        activation_checkpointing=run.activation_checkpointing.enabled,
        checkpoint_every_n_layers=run.activation_checkpointing.every_n_layers, seed=run.train.seed,
        compile=run.train.compile, loss_impl=run.train.loss_impl, lora=run.lora, packed=run.data.packing,
        token_weighted=token_weighted, tiled_mlp=run.activation_checkpointing.tiled_mlp,
        offload_hidden_states=run.activation_checkpointing.offload_hidden_states)


def probe_micro_batch(spec: models.ModelSpec, config: JobConfig, resolved: Resolved, options: EngineOptions,
                      data: TrainingData, world: World) -> int:
    """`batch.micro_batch=auto`: the largest micro-batch that fits (a probe on throw-away engines)."""
    micro, note = autobatch.choose_micro_batch(spec, config.probe_config(), resolved.ds_config["train_batch_size"],
                                               options, data, world)
    if world.is_main:
        log.info("%s", note)
    seed_everything(resolved.run.train.seed)  # the probe's steps drew from the RNG
    return micro


def resume_from(engine: Engine, plan: ResumePlan, world: World, data: TrainingData, seed: int,
                trust: bool = False) -> CheckpointState:
    """Load the planned checkpoint (universal when the shape changed); returns its saved state.

    The state (step, losses, data position) comes from the bigtrain.json marker of the
    checkpoint found; the sampler continues the same global sample order at another
    data-parallel size.
    """
    checkpoint.load(engine.ds, plan.ckpt_dir, plan.load_tag, trust=trust)
    start_schedule(engine.scheduler)  # the restored iteration's rate (universal checkpoints do not hold it)
    rng, objective_state = restore_rng(plan, world.rank, seed, trust)
    if objective_state is not None:
        engine.objective.load_state_dict(objective_state)
    data.load_state_dict(plan.state.data)
    if world.is_main:
        log.info("resumed from %s at step %d (RNG %s)", plan.ckpt_dir / plan.load_tag, plan.state.step, rng)
    return plan.state


def loop_settings(run: RunConfig, ckpt_dir: Path, stop_after: int | None, plan: ResumePlan | None) -> LoopSettings:
    return LoopSettings(steps=run.train.steps, eval_interval=run.train.eval_interval,
                        eval_batches=run.train.eval_batches, ckpt_dir=ckpt_dir, ckpt_interval=run.checkpoint.interval,
                        keep_last=run.checkpoint.keep_last, save_at_end=run.checkpoint.at_end, stop_after=stop_after,
                        max_loss=run.train.max_loss,
                        resumed_from=plan.ckpt_dir / plan.tag if plan else None)


def finish(resolved: Resolved, world: World, out: Path, reporter: Reporter, result: LoopResult,
           lifeline: Lifeline, data_stats: dict | None = None, hub: dict | None = None) -> dict:
    """The run's summary (every rank's memory figures: an all-gather), written with its loss plot by rank 0.
    `data_stats`: chat/instruction examples' counts and padding, kept as "data" with the rate of real (not
    padding) tokens, which is what packing raises. `hub`: the Hub models it used, at their commits."""
    with lifeline.bound("the run summary", end_of_run_bound_s(), "every rank's memory figures (an all-gather)"):
        summary = reporter.summary(result, run_config=to_dict(resolved.run), ds_config=resolved.recorded,
                                   **({"hub": hub} if hub else {}))
    if data_stats:
        summary["data"] = dict(data_stats)
        if "pad_share" in data_stats:  # examples padded to rows (prompt records have no rows of their own)
            summary["data"]["real_tokens_per_s"] = summary.get("tokens_per_s", 0.0) * (1 - data_stats["pad_share"])
    if world.is_main:
        log.info("wrote %s", write_summary(out, summary))
        write_loss_plot(summary, out / "loss.png")
    return summary


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


@dataclass(frozen=True)
class RunRecord:
    """What every checkpoint of this run records beside DeepSpeed's files: the data position, the loss
    history, and how to rebuild the model (resume and export read them)."""

    run: RunConfig
    ds_config: dict  # `Resolved.recorded`: the dict it trains with
    world: World
    data: TrainingData
    model_build: dict  # ModelBuild.to_json()

    def state_at(self, step: int, losses: list[float], history: dict | None = None) -> CheckpointState:
        data = self.data
        tokenizer = data.tokenizer_dir.resolve() if data.tokenizer_dir else None
        return CheckpointState(step=step, world_size=self.world.size, pipeline_stages=self.run.pipeline.stages,
                               data=data.state_dict(), losses=list(losses),
                               history=dict(history or {}), model_build=ModelBuild(**self.model_build),
                               run_config=to_dict(self.run), ds_config=self.ds_config,
                               run_dir=Path(self.run.train.out_dir).resolve(), tokenizer_dir=tokenizer,
                               prompts=data.bundle.prompts)


def schedule_change_line(saved_run: dict, run: RunConfig, next_lr: float, step: int) -> str | None:
    """A resume with another train.steps rebuilds the learning-rate schedule over the new length: say so."""
    before = (saved_run.get("train") or {}).get("steps")
    if before is None or before == run.train.steps:
        return None
    return (f"train.steps {before} -> {run.train.steps} on --resume: the learning-rate schedule is rebuilt for "
            f"{run.train.steps} steps, so step {step + 1} trains at {next_lr:.3g} on the new schedule (the old one "
            f"{'had ended' if step >= before else 'was'} at step {step}; the rate may jump)")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _batch_line(ds_config: dict, engine: Engine, world: World) -> str:
    return (f"world size {world.size}, data-parallel {engine.dp_size}: train_batch_size "
            f"{ds_config['train_batch_size']} = micro {ds_config['train_micro_batch_size_per_gpu']} x accum "
            f"{ds_config['gradient_accumulation_steps']} x dp {engine.dp_size}")
