"""The cross-field rules of a training layout, in one place.

ZeRO stage x offload x pipeline, the pipeline partition method, LoRA against the split: DeepSpeed
checks some of these late (deep inside `initialize`, with an assertion) and some never (a layout that
silently does something else). The run config's validation, the DeepSpeed-JSON lint, the benchmark
cases, the memory estimator and the pipeline builder all ask these functions, each naming the keys in
its own vocabulary (`RUN_KEYS` for run-config fields, `DS_KEYS` for DeepSpeed JSON keys), so the rule
and its wording exist once. The split sizes' own rules (divisibility, which axes combine) are the
topology's (`bigtrain.config.topology.Topology`).

Pure: no DeepSpeed import, no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass

from bigtrain.config.topology import RUN_AXES, Axes

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


def zero_plus_plus_problem(stage: int, set_fields: dict[str, object]) -> str | None:
    """ZeRO++ is stage 3's communication (hpZ, qwZ, qgZ): DeepSpeed reads its keys at stage 3 only and ignores them
    below, so a field set there would silently do nothing."""
    if set_fields and stage != 3:
        shown = ", ".join(f"{k}={str(v).lower()}" for k, v in set_fields.items())
        return (f"{shown} with zero.stage={stage}: ZeRO++ changes ZeRO-3's collectives and DeepSpeed ignores it at "
                f"stage {stage}; set zero.stage=3 or leave the ZeRO++ fields at their defaults")
    return None


def muon_problems(optimizer: str, schedule_kind: str, zero_plus_plus: dict[str, object], zero_stage: int = 1,
                  grad_clip: float = 0.0) -> list[str]:
    """DeepSpeed's Muon keeps its own learning rate only under a schedule that scales each parameter group's rate
    (WarmupCosineLR); WarmupLR / WarmupDecayLR set every group to one absolute rate. ZeRO-3 runs Muon without the
    all-to-all that quantized gradients reduce by. ZeRO 1-3 orthogonalize while they reduce, so DeepSpeed clips
    Muon's update there and the raw gradient at ZeRO-0 (measured: equal curves at ZeRO 1-3, ZeRO-0 apart unless
    clipping is off)."""
    if optimizer != "muon":
        return []
    problems = []
    if zero_stage == 0 and grad_clip > 0:
        problems.append(f"optimizer.name=muon with zero.stage=0 and optimizer.grad_clip={grad_clip}: DeepSpeed clips "
                        "the raw gradient at ZeRO-0 but Muon's orthogonalized update at ZeRO 1-3, so ZeRO-0 would train "
                        "another curve; set zero.stage to 1-3, or optimizer.grad_clip=0 (every stage then agrees)")
    if schedule_kind != "cosine":
        problems.append(f"optimizer.name=muon with schedule.kind={schedule_kind}: DeepSpeed's {schedule_kind} schedule "
                        "sets every parameter group to one learning rate, so Muon's weights would train at "
                        "optimizer.lr, not optimizer.muon_lr; use schedule.kind=cosine (it scales each group's own)")
    if zero_plus_plus.get("zero.quantized_gradients"):
        problems.append("optimizer.name=muon with zero.quantized_gradients=true: DeepSpeed's ZeRO-3 refuses Muon with "
                        "the all-to-all that quantized gradients reduce by; set one of them off")
    return problems


# `activation_checkpointing.tiled_mlp=auto` turns ALST's tiled MLP on when a rank's tokens per sample reach this many
# times the model's hidden size (its tiles are hidden_size tokens: at 4 tiles a SwiGLU MLP's intermediates, ~3x the
# hidden width per token, outweigh the one tile recomputed at a time).
AUTO_TILES = 4


def tiled_mlp_wanted(setting: bool | str, tokens_per_rank: int | None, hidden: int | None) -> bool:
    """`activation_checkpointing.tiled_mlp`: true / false, or auto = at least AUTO_TILES tiles of hidden_size tokens
    on each rank (data.seq_len / parallel.sequence >= AUTO_TILES x the hidden size). The engine, the estimator and
    the preflight resolve it here alike."""
    if setting != "auto":
        return bool(setting)
    return bool(tokens_per_rank and hidden and tokens_per_rank >= AUTO_TILES * hidden)


def offload_hidden_states_wanted(setting: bool | str, device_name: str, checkpointing: bool,
                                 tokens_per_rank: int | None, hidden: int | None) -> bool:
    """`activation_checkpointing.offload_hidden_states`: true / false, or auto = activation checkpointing on, a
    device whose memory is not the host's (not a CPU), and the tiled MLP's long-sequence rule."""
    if setting != "auto":
        return bool(setting)
    return checkpointing and device_name != "cpu" and tiled_mlp_wanted("auto", tokens_per_rank, hidden)


def partition_problem(method: str, key: str = "pipeline.partition_method") -> str | None:
    """DeepSpeed's PipelineModule splits layers by parameter count, uniformly, or by a layer-type regex."""
    if method in PARTITION_METHODS or (isinstance(method, str) and method.startswith("type:")):
        return None
    return f"{key}={method!r}: use 'parameters', 'uniform' or 'type:REGEX'"


def lora_problems(rank: int, pipeline: int, tensor: int, keys: Axes = RUN_AXES, expert: int = 1) -> list[str]:
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
    if rank > 0 and expert > 1:
        problems.append(f"lora.r={rank} with {keys.expert}={expert}: DeepSpeed's AutoEP repacks the experts into "
                        f"its own layer, which bigtrain has not proven with peft's adapters; set {keys.expert}=1 "
                        "(ZeRO partitions the experts)")
    return problems
