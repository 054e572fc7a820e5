"""The cross-field rules of a training layout, in one place.

ZeRO stage x offload x pipeline, the pipeline partition method, LoRA against the split: DeepSpeed
checks some of these late (deep inside `initialize`, with an assertion) and some never (a layout that
silently does something else). The run config's validation, the DeepSpeed-JSON lint, the benchmark
cases, the memory estimator and the pipeline builder all ask these functions, each naming the keys in
its own vocabulary (`RUN_KEYS` for run-config fields, `DS_KEYS` for DeepSpeed JSON keys), so the rule
and its wording exist once. The split sizes' own rules (divisibility, which axes combine) are the
topology's (`bigtrain.parallel.topology.Topology`).

Pure: no DeepSpeed import, no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass

from bigtrain.parallel.topology import RUN_AXES, Axes

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


def partition_problem(method: str, key: str = "pipeline.partition_method") -> str | None:
    """DeepSpeed's PipelineModule splits layers by parameter count, uniformly, or by a layer-type regex."""
    if method in PARTITION_METHODS or (isinstance(method, str) and method.startswith("type:")):
        return None
    return f"{key}={method!r}: use 'parameters', 'uniform' or 'type:REGEX'"


def lora_problems(rank: int, pipeline: int, tensor: int, keys: Axes = RUN_AXES) -> list[str]:
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
