"""The checks for DeepSpeed 0.17-0.19's levers: ZeRO++ (hpZ, the quantized collectives), Muon against ZeRO, and
expert parallelism (AutoEP, validated by DeepSpeed's own `validate_autoep_config`). One line each (`Problem`), as in
`checks`; `judge.lint_problems` runs them in the same pass."""
from __future__ import annotations

from bigtrain.ds.lint.checks import (DeviceCaps, Problem, first_line, is_int, offload_device, parallel_problems, show,
                                     topology_of,
                                     zero_section)


ZERO_PLUS_PLUS_KEYS = ("zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients",
                       "zero_quantized_nontrainable_weights")
QUANTIZED = ZERO_PLUS_PLUS_KEYS[1:]


def zero_plus_plus_problems(config: dict, world_size: int | None, device: DeviceCaps) -> list[Problem]:
    """ZeRO++: read by ZeRO-3 only; hpZ's secondary groups must divide the world (`groups.
    _create_zero_param_parallel_group`); the quantized collectives need DeepSpeed's quantizer kernel, which an
    accelerator without it (the CPU's) cannot load."""
    zero = zero_section(config)
    stage = zero.get("stage", 0)
    hpz = zero.get("zero_hpz_partition_size", 1)
    on = [key for key in QUANTIZED if zero.get(key) is True]
    on = ([ZERO_PLUS_PLUS_KEYS[0]] if is_int(hpz) and hpz > 1 else []) + on
    if not on or not is_int(stage):
        return []
    if stage != 3:
        return [Problem(f"zero_optimization.{key}", f"={show(zero[key])} at stage {stage}: ZeRO++ changes ZeRO-3's "
                                                    "collectives and DeepSpeed ignores it below; set stage 3 or "
                                                    "remove it", level="warning") for key in on]
    problems = []
    if is_int(hpz) and hpz > 1 and world_size is not None and world_size % min(hpz, world_size):
        problems.append(Problem("zero_optimization.zero_hpz_partition_size",
                                f"={hpz} does not divide the {world_size} ranks: DeepSpeed builds hpZ's secondary "
                                f"groups of {hpz} consecutive ranks; choose a divisor of {world_size} (the GPUs of "
                                "a node)"))
    quantized = [key for key in on if key in QUANTIZED]
    if quantized and not has_quantizer(device):
        problems += [Problem(f"zero_optimization.{key}", f"=true needs DeepSpeed's quantizer kernel "
                                                         f"(QuantizerBuilder), which the {device.name} accelerator "
                                                         "does not have; set it to false here, or lint with "
                                                         "--device cuda for a GPU host") for key in quantized]
    return problems


def has_quantizer(device: DeviceCaps) -> bool:
    """Whether DeepSpeed's accelerator for `device` builds its quantizer op (ZeRO++'s int8/int4 collectives)."""
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    if device.name != accelerator.device_name():
        if device.name != "cpu":
            return True  # a GPU host: CUDA/ROCm builds it
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
        accelerator = CPU_Accelerator()
    builder = accelerator.get_op_builder("QuantizerBuilder")  # a class; the CPU's stands in NotImplementedBuilder
    return builder is not None and getattr(builder, "__name__", type(builder).__name__) != "NotImplementedBuilder"


def muon_zero_problems(config: dict) -> list[Problem]:
    """What DeepSpeed's ZeRO-3 refuses with Muon (`stage3.py`: reduce_scatter, the quantized gradients'
    all-to-all), and a schedule that would set Muon's rate to Adam's."""
    optimizer = config.get("optimizer")
    if not isinstance(optimizer, dict) or str(optimizer.get("type", "")).lower() != "muon":
        return []
    zero, problems = zero_section(config), []
    if zero.get("stage") == 3:
        if zero.get("reduce_scatter", True) is not False:
            problems.append(Problem("zero_optimization.reduce_scatter", f"={show(zero.get('reduce_scatter', True))}"
                                    f"{'' if 'reduce_scatter' in zero else ' (its default)'} with Muon: DeepSpeed's "
                                    "ZeRO-3 refuses them together; set \"reduce_scatter\": false"))
        if zero.get("zero_quantized_gradients") is True:
            problems.append(Problem("zero_optimization.zero_quantized_gradients", "=true with Muon: DeepSpeed's ZeRO-3 "
                                    "refuses Muon with the all-to-all it reduces by; set it to false"))
    clip = config.get("gradient_clipping", 1.0)  # DeepSpeed's default
    if zero.get("stage", 0) == 0 and isinstance(clip, (int, float)) and clip > 0:
        problems.append(Problem("gradient_clipping", f"={show(clip)} with Muon at ZeRO-0: DeepSpeed clips the raw "
                                                     "gradient there but Muon's orthogonalized update at ZeRO 1-3, so "
                                                     "the same run trains another curve per stage", level="warning"))
    scheduler = config.get("scheduler")
    kind = scheduler.get("type") if isinstance(scheduler, dict) else None
    if kind in ("WarmupLR", "WarmupDecayLR"):
        problems.append(Problem("scheduler.type", f"={show(kind)} with Muon: it sets every parameter group to one "
                                                  "learning rate (warmup_max_lr), Muon's muon_lr included; "
                                                  "WarmupCosineLR scales each group's own", level="warning"))
    return problems


def autoep_problems(config: dict, world: int) -> list[Problem]:
    """DeepSpeed's own AutoEP validation (`validate_autoep_config`: sizes, folding, presets, option values) on the
    `expert_parallel` section, and what its engine asserts at ZeRO-3 (hpZ, quantized gradients)."""
    section = config.get("expert_parallel")
    if not isinstance(section, dict) or section.get("enabled") is not True:
        return []
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config, validate_autoep_config
    topology = topology_of(config, world)
    zero = zero_section(config)
    stage = zero.get("stage", 0) if is_int(zero.get("stage", 0)) else 0
    try:
        validate_autoep_config(parse_autoep_config(section), world, topology.pipeline, topology.tensor,
                               topology.sequence, zero_stage=stage,
                               zero_offload_optimizer=offload_device(zero, "offload_optimizer") != "none",
                               zero_offload_param=offload_device(zero, "offload_param") != "none")
    except (ValueError, AssertionError, TypeError) as err:
        return [Problem("expert_parallel", f"DeepSpeed's AutoEP refuses it: {first_line(err)}")]
    problems = []
    if stage == 3 and zero.get("zero_quantized_gradients") is True:
        problems.append(Problem("zero_optimization.zero_quantized_gradients", "=true with expert_parallel at stage 3: "
                                "DeepSpeed's AutoEP does not support it yet; set it to false"))
    hpz = zero.get("zero_hpz_partition_size", 1)
    if stage == 3 and is_int(hpz) and hpz > 1:
        problems.append(Problem("zero_optimization.zero_hpz_partition_size", f"={hpz} with expert_parallel at stage "
                                "3: DeepSpeed's AutoEP does not support hpZ's secondary groups yet; set it to 1"))
    return problems


def split_problems(config: dict, world_size: int | None) -> list[Problem]:
    """The split's sizes (`checks.parallel_problems`), then, where they hold, DeepSpeed's AutoEP validation."""
    problems = parallel_problems(config, world_size)
    topology = topology_of(config, world_size or 1)
    return problems or autoep_problems(config, world_size or topology.replica * topology.expert)
