"""The typed run config: the single place a setting lives. Its sections are in `bigtrain.config.sections`; here
the whole, and the rules that join sections (what DeepSpeed would otherwise report deep inside initialize()).

Every field is documented in its `doc` metadata; `bigtrain configs --explain` and error
messages read it. The DeepSpeed JSON is derived from this object (`bigtrain.ds.generate`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from bigtrain.fields import doc
from bigtrain.config.objective import ObjectiveConfig
from bigtrain.config.rules import RUN_KEYS, Layout, check_layout, lora_problems, muon_problems, optimizer_problems
from bigtrain.config.sections import (ActivationCheckpointConfig, BatchConfig, CheckpointConfig, DataConfig,
                                      LoggingConfig, LoraConfig, ModelConfig, OffloadConfig, OffloadDevice,
                                      OptimizerConfig, ParallelConfig, PipelineConfig, ScheduleConfig, TrainConfig,
                                      ZeroConfig)
from bigtrain.config.defaults import choose, filled, unset
from bigtrain.config.topology import Topology
from bigtrain.objectives import batch_problem, resolve_reference

Precision = Literal["auto", "fp32", "bf16", "fp16"]
__all__ = ["RunConfig", "Precision", "OffloadDevice", "check_combinations", "ModelConfig", "DataConfig",
           "OptimizerConfig", "ScheduleConfig", "BatchConfig", "ZeroConfig", "OffloadConfig",
           "ActivationCheckpointConfig", "PipelineConfig", "ParallelConfig", "LoraConfig", "ObjectiveConfig",
           "LoggingConfig", "CheckpointConfig", "TrainConfig"]


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    precision: Precision = doc("auto", "fp32, bf16 (mixed), fp16 (mixed, loss scaling) or auto: bf16 on GPUs, "
                               "on a CPU bf16 with AMX else fp32.")
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    activation_checkpointing: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        if unset(self.optimizer, self.schedule):  # the rate, weight decay, betas and warm-up: by what the run is
            chosen = choose(self.model.pretrained, self.objective.kind, self.lora.r > 0)
            self.optimizer, self.schedule = filled(self.optimizer, self.schedule, chosen)
        check_combinations(self)


def check_combinations(run: RunConfig) -> None:
    """Cross-section rules DeepSpeed would otherwise report deep inside initialize() (`bigtrain.config.rules`)."""
    check_layout(Layout(run.zero.stage, run.offload.optimizer, run.offload.param, run.pipeline.stages), RUN_KEYS)
    problems = optimizer_problems(run.optimizer.name, run.precision, run.zero.stage)
    problems += muon_problems(run.optimizer.name, run.schedule.kind, run.zero.plus_plus(), run.zero.stage,
                              run.optimizer.grad_clip)
    if problems:
        raise ValueError(problems[0])
    # the sizes' combinations; the world is not known yet (checked with it: `Topology.check`)
    problems = Topology.of_run(run.parallel, run.pipeline.stages, world=0).combination_problems()
    problems += lora_problems(run.lora.r, run.pipeline.stages, run.parallel.tensor, expert=run.parallel.expert)
    if problems:
        raise ValueError("\n".join(problems))
    if run.parallel.sequence > 1 and run.data.seq_len % run.parallel.sequence:
        raise ValueError(f"data.seq_len={run.data.seq_len} is not divisible by parallel.sequence="
                         f"{run.parallel.sequence}: each sequence-parallel rank takes an equal slice; choose a "
                         f"multiple of {run.parallel.sequence}")
    if run.activation_checkpointing.offload_hidden_states is True and run.pipeline.stages > 1:
        raise ValueError(f"activation_checkpointing.offload_hidden_states=true with pipeline.stages="
                         f"{run.pipeline.stages}: bigtrain offloads the hidden states of plain modules only; set it "
                         "to auto or false, or pipeline.stages=1")
    if run.activation_checkpointing.tiled_mlp is True and run.pipeline.stages > 1:
        raise ValueError(f"activation_checkpointing.tiled_mlp=true with pipeline.stages={run.pipeline.stages}: bigtrain "
                         "tiles the MLPs of plain modules only; set tiled_mlp to auto or false, or pipeline.stages=1")
    if run.data.packing and run.pipeline.stages > 1:
        raise ValueError(f"data.packing=true with pipeline.stages={run.pipeline.stages}: pipeline stages number the "
                         "positions themselves, so packed examples would attend to each other; set data.packing=false "
                         "or pipeline.stages=1")
    if run.data.padding == "longest" and (run.pipeline.stages > 1 or run.parallel.sequence > 1):
        raise ValueError(f"data.padding=longest with pipeline.stages={run.pipeline.stages} / parallel.sequence="
                         f"{run.parallel.sequence}: pipeline stages and sequence-parallel ranks need rows of one "
                         "length; set data.padding to auto or max_length")
    if run.batch.micro_batch == "auto" and run.parallel.tensor * run.parallel.sequence > 1:
        raise ValueError(f"batch.micro_batch=auto with parallel.tensor={run.parallel.tensor} / parallel.sequence="
                         f"{run.parallel.sequence}: the probe sizes one rank's own batch; give batch.micro_batch as "
                         "a number")
    problems = objective_problems(run) + vision_problems(run)
    if problems:
        raise ValueError(problems[0])
    if run.batch.micro_batch == "auto" and run.pipeline.stages > 1:
        raise ValueError(f"batch.micro_batch=auto with pipeline.stages={run.pipeline.stages}: the probe sizes plain "
                         "modules only; give batch.micro_batch as a number")


def objective_problems(run: RunConfig) -> list[str]:
    """What the objective declares it cannot run with (`bigtrain.objectives.base.Needs`), one line each, checked
    before any rank starts."""
    kind, needs = run.objective.kind, run.objective.declared
    why = needs.refuses
    problems = []
    if run.pipeline.stages > 1 and not needs.allows("pipeline"):
        problems.append(f"objective.kind={kind} with pipeline.stages={run.pipeline.stages}: {why['pipeline']}; set "
                        "pipeline.stages=1 (ZeRO-3 shards the model instead)")
    split = [axis for axis in ("tensor", "sequence") if getattr(run.parallel, axis) > 1 and not needs.allows(axis)]
    if split:
        problems.append(f"objective.kind={kind} with parallel.tensor={run.parallel.tensor} / parallel.sequence="
                        f"{run.parallel.sequence}: {why[split[0]]}; train it with ZeRO (and LoRA)")
    problems += frozen_model_problems(run)
    # the batch's whole groups need the world size: bigtrain.ds.groups, before the launch and on the ranks
    if line := batch_problem(kind, needs, seq_len=run.data.seq_len):
        problems.append(line)
    if run.data.packing and not needs.allows("packing"):
        problems.append(f"objective.kind={kind} with data.packing=true: {why['packing']}; set data.packing=false")
    if run.objective.reference == "adapters_off" and run.lora.r == 0:
        problems.append("objective.reference=adapters_off: the policy has no adapters to switch off (lora.r=0); set "
                        "lora.r (e.g. 16), or objective.reference=copy (or auto)")
    if run.batch.micro_batch == "auto" and not needs.allows("auto_micro_batch"):
        problems.append(f"batch.micro_batch=auto with objective.kind={kind}: {why['auto_micro_batch']}; give "
                        "batch.micro_batch as a number (of samples)")
    elif isinstance(run.batch.micro_batch, int) and run.batch.micro_batch < needs.min_micro_batch:
        problems.append(f"objective.kind={kind} with batch.micro_batch={run.batch.micro_batch}: {why['micro_batch']}; "
                        f"set batch.micro_batch to {needs.min_micro_batch} or more")
    explicit = [f"train.{key}={value}" for key, value, mode in (("compile", run.train.compile, "compile"),
                                                                ("loss_impl", run.train.loss_impl, "chunked_loss"))
                if value not in ("auto", False, "plain") and not needs.allows(mode)]
    if explicit:
        mode = "compile" if explicit[0].startswith("train.compile") else "chunked_loss"
        problems.append(f"{', '.join(explicit)} with objective.kind={kind}: {why[mode]}; set it to auto (or false / "
                        "plain)")
    return problems


def vision_problems(run: RunConfig) -> list[str]:
    """What a vision-language model (--model vlm) cannot train with: packed rows (their examples kept apart by
    restarting positions, which the families' image-token masks do not follow) and a reference computed before
    training (its table is of the answers' tokens alone, without their images)."""
    from bigtrain.models.names import reads_images
    if not reads_images(run.model.family):
        return []
    problems = []
    if run.data.packing:
        problems.append("data.packing=true with --model vlm: packed rows keep their examples apart by restarting "
                        "positions, which the families' image-token attention does not follow; set "
                        "data.packing=false")
    if run.objective.reference == "precomputed":
        problems.append("objective.reference=precomputed with --model vlm: the table is computed over the answers' "
                        "tokens without their images; use objective.reference=auto (a copy, or the adapters switched "
                        "off with LoRA)")
    needs = run.objective.declared
    readers = [f"objective.{f.setting}" for f in needs.frozen_models
               if f.head == "own" and f.directory(run.objective.settings) is not None]
    if readers:  # a teacher scores the policy's completions token by token, as it reads them: without the images
        problems.append(f"{readers[0]} with --model vlm: the frozen model would read the completions without their "
                        f"images; not supported for a vision-language policy")
    if getattr(run.objective.settings, "uses_tools", False):  # the turns are rendered as text (bigtrain.rollout.agent)
        problems.append("objective.tools / objective.environment with --model vlm: a rollout's turns of calls and "
                        "results are rendered without the prompts' images; tools are for text models (drop them, or "
                        "train a text model)")
    return problems


def frozen_model_problems(run: RunConfig) -> list[str]:
    """Ulysses replaces transformers' attention for the whole process (DeepSpeed's design): a frozen model beside
    the policy (a reference copy, an objective's own) would run with it."""
    needs = run.objective.declared
    beside = [f"objective.{frozen.setting}" for frozen in needs.frozen_models
              if frozen.directory(run.objective.settings) is not None]
    if resolve_reference(needs, run.objective.reference, run.lora.r > 0) == "copy":
        beside.append("objective.reference=copy")
    if run.parallel.sequence == 1 or not beside:
        return []
    return [f"parallel.sequence={run.parallel.sequence} with {' and '.join(beside)}: Ulysses replaces transformers' "
            "attention for the whole process, so the frozen model beside the policy would run with it; set "
            "parallel.sequence=1 (ZeRO-3 shards the models instead)"]
