"""The cross-field rules of a training layout, in one place.

ZeRO stage x offload x pipeline, world size x pipeline stages, and the pipeline partition
method: DeepSpeed checks some of these late (deep inside `initialize`, with an assertion) and
some never (a layout that silently does something else). The run config's validation, the
DeepSpeed-JSON lint, the benchmark cases, the memory estimator and the pipeline builder all
ask these functions, each naming the keys in its own vocabulary (`RUN_KEYS` for run-config
fields, `DS_KEYS` for DeepSpeed JSON keys), so the rule and its wording exist once.

Pure: no DeepSpeed import, no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass

ONE_BIT_OPTIMIZERS = ("onebitadam", "zerooneadam", "onebitlamb")
PARTITION_METHODS = ("parameters", "uniform")  # or "type:REGEX"


@dataclass(frozen=True)
class Keys:
    """How a caller names the settings in its messages; `{device}` is filled in."""

    stage: str
    pipeline_stages: str
    optimizer_offload: str  # the optimizer-offload section (or field=value)
    param_offload: str
    optimizer_device: str  # the key holding the optimizer-offload device
    param_device: str


RUN_KEYS = Keys("zero.stage", "pipeline.stages", "offload.optimizer={device}", "offload.param={device}",
                "offload.optimizer", "offload.param")
DS_KEYS = Keys("zero_optimization.stage", "pipeline.stages", "zero_optimization.offload_optimizer",
               "zero_optimization.offload_param", "zero_optimization.offload_optimizer.device",
               "zero_optimization.offload_param.device")


@dataclass(frozen=True)
class Layout:
    """What the rules look at; offload devices are "none", "cpu" or "nvme"."""

    zero_stage: int
    optimizer_offload: str = "none"
    param_offload: str = "none"
    pipeline_stages: int = 1


def layout_problems(layout: Layout, keys: Keys = RUN_KEYS) -> list[str]:
    """Every combination of ZeRO stage, offload and pipeline that DeepSpeed cannot run, one line each."""
    stage, problems = layout.zero_stage, []
    if layout.pipeline_stages > 1 and stage >= 2:
        problems.append(f"{keys.stage}={stage} with {layout.pipeline_stages} pipeline stages: DeepSpeed pipelines "
                        f"support ZeRO 0-1 only; set {keys.stage} to 0 or 1, or {keys.pipeline_stages} to 1")
    opt, param = layout.optimizer_offload, layout.param_offload
    if param != "none" and stage != 3:
        section = keys.param_offload.format(device=param)
        problems.append(f"{section} needs stage 3 (got stage {stage}): only ZeRO-3 partitions the parameters, so "
                        f"only it offloads them; set {keys.stage} to 3 or {keys.param_device} to none")
    if opt != "none" and stage == 0:
        section = keys.optimizer_offload.format(device=opt)
        problems.append(f"{section} needs stage 1-3 (got stage 0): ZeRO-0 has no optimizer partition to offload; "
                        f"set {keys.stage} to 1 or higher, or {keys.optimizer_device} to none")
    for device_key, device in ((keys.optimizer_device, opt), (keys.param_device, param)):
        if device == "nvme" and stage != 3:
            problems.append(f"{device_key}=nvme needs stage 3 (ZeRO-Infinity), got stage {stage}; set {keys.stage} "
                            f"to 3 or offload to cpu")
    return problems


def check_layout(layout: Layout, keys: Keys = RUN_KEYS) -> None:
    """ValueError with every problem of `layout` (one per line)."""
    problems = layout_problems(layout, keys)
    if problems:
        raise ValueError("\n".join(problems))


def optimizer_problems(optimizer: str, precision: str, zero_stage: int) -> list[str]:
    """The 1-bit optimizers with fp16 support ZeRO 0-1 only."""
    if precision == "fp16" and optimizer in ONE_BIT_OPTIMIZERS and zero_stage > 1:
        return [f"optimizer.name={optimizer} supports zero.stage 0-1 only"]
    return []


def divisibility_problem(world_size: int, pipeline_stages: int, key: str = "pipeline.stages") -> str | None:
    """A world size must split into whole model replicas: `pipeline_stages` (x tensor x sequence) ranks each."""
    if world_size < 1 or pipeline_stages < 1:
        return f"world size {world_size} and {key} {pipeline_stages} must both be >= 1"
    if world_size % pipeline_stages:
        return (f"world size {world_size} is not divisible by {key}={pipeline_stages}: launch a multiple of "
                f"{pipeline_stages} ranks (e.g. --num_gpus {pipeline_stages * max(1, world_size // pipeline_stages)})"
                f" or choose {key} dividing {world_size}")
    return None


def data_parallel_size(world_size: int, pipeline_stages: int = 1, key: str = "pipeline.stages", tensor: int = 1,
                       sequence: int = 1) -> int:
    """Ranks holding a full replica's worth of data (world / (pipeline x tensor x sequence)); ValueError naming
    the sizes when the world does not split."""
    split = pipeline_stages * tensor * sequence
    if tensor * sequence > 1 and world_size >= 1 and world_size % split:
        sizes = " x ".join(f"{name}={size}" for name, size in (
            (key, pipeline_stages), ("parallel.tensor", tensor), ("parallel.sequence", sequence)) if size > 1)
        raise ValueError(f"world size {world_size} is not divisible by {sizes} = {split} ranks per model replica: "
                         f"launch a multiple of {split} ranks or choose sizes whose product divides {world_size}")
    problem = divisibility_problem(world_size, split, key)
    if problem:
        raise ValueError(problem)
    return world_size // split


@dataclass(frozen=True)
class ParallelKeys:
    """How a caller names the split sizes: run-config fields, or a DeepSpeed JSON's keys."""

    pipeline: str
    tensor: str
    sequence: str
    expert: str


RUN_PARALLEL = ParallelKeys("pipeline.stages", "parallel.tensor", "parallel.sequence", "parallel.expert")
DS_PARALLEL = ParallelKeys("pipeline.stages", "tensor_parallel.autotp_size", "sequence_parallel_size",
                           "expert_parallel.autoep_size")


def parallel_problems(pipeline: int, tensor: int, sequence: int, expert: int,
                      keys: ParallelKeys = RUN_PARALLEL) -> list[str]:
    """Combinations of the split sizes that DeepSpeed 0.19.8 cannot run together, one line each."""
    problems = []
    for name, size in ((keys.tensor, tensor), (keys.sequence, sequence)):
        if size > 1 and pipeline > 1:
            problems.append(f"{name}={size} with {keys.pipeline}={pipeline}: DeepSpeed's pipeline engine takes its "
                            f"own process groups and runs neither AutoTP nor Ulysses; set {name}=1 or "
                            f"{keys.pipeline}=1")
    if tensor > 1 and sequence > 1:
        problems.append(f"{keys.tensor}={tensor} with {keys.sequence}={sequence}: DeepSpeed's AutoTP replaces the "
                        f"Ulysses process groups its engine is given; use one of them (sequence for long "
                        "sequences, tensor for layers too large for one device)")
    if expert > 1:
        problems.append(f"{keys.expert}={expert}: DeepSpeed's AutoEP crashes with the installed transformers "
                        "(auto_ep_presets against transformers' output capturing); train the experts with ZeRO "
                        f"(they are partitioned like every weight at zero.stage 3) and {keys.expert}=1")
    return problems


def partition_problem(method: str, key: str = "pipeline.partition_method") -> str | None:
    """DeepSpeed's PipelineModule splits layers by parameter count, uniformly, or by a layer-type regex."""
    if method in PARTITION_METHODS or (isinstance(method, str) and method.startswith("type:")):
        return None
    return f"{key}={method!r}: use 'parameters', 'uniform' or 'type:REGEX'"


def lora_problems(rank: int, pipeline: int, tensor: int, keys: ParallelKeys = RUN_PARALLEL) -> list[str]:
    """LoRA adapters are put on the plain module from outside (`bigtrain.parallel.lora`): neither a pipeline's
    stages nor AutoTP's sharded layers are that module."""
    problems = []
    if rank > 0 and pipeline > 1:
        problems.append(f"lora.r={rank} with {keys.pipeline}={pipeline}: the adapters go on the plain module and "
                        f"DeepSpeed's pipeline engine builds its own stages; set {keys.pipeline}=1 (ZeRO-3 "
                        "partitions the frozen base instead)")
    if rank > 0 and tensor > 1:
        problems.append(f"lora.r={rank} with {keys.tensor}={tensor}: DeepSpeed's AutoTP shards nn.Linear layers, "
                        f"which peft's adapter layers wrap out of its sight; set {keys.tensor}=1 (ZeRO-3 partitions "
                        "the frozen base instead)")
    return problems
