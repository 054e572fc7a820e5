"""The checks `deepspeed.initialize` makes beyond the config's keys: batch, layout, device, parallelism.

Each returns `Problem`s (one line each) instead of raising, so `lint_problems` (`judge`) reports them
all in one pass; the optimizer and scheduler checks are in `optim`.
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any

from bigtrain.config.rules import DS_KEYS, Layout, layout_problems
from bigtrain.ds.lint import schema
from bigtrain.parallel.topology import DS_AXES, Topology

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")



@dataclass(frozen=True)
class Problem:
    """One finding: `path` is the dotted key ("" for the file), `message` reads after it."""

    path: str
    message: str
    level: str = "error"  # or "warning"

    def __str__(self) -> str:
        prefix = "warning: " if self.level == "warning" else ""
        if not self.path or self.message.startswith((self.path, "unknown key", "key ")):
            return prefix + self.message
        return prefix + self.path + ("" if self.message.startswith("=") else ": ") + self.message


@dataclass(frozen=True)
class DeviceCaps:
    """What the target device can do; `local` = the machine lint runs on (paths can be checked)."""

    name: str  # "cpu", "cuda", ...
    fp16: bool
    bf16: bool
    local: bool = True

    @staticmethod
    def detect() -> "DeviceCaps":
        from deepspeed.accelerator import get_accelerator
        acc = get_accelerator()
        return DeviceCaps(acc.device_name(), bool(acc.is_fp16_supported()), bool(acc.is_bf16_supported()))

    @staticmethod
    def for_device(name: str) -> "DeviceCaps":
        """`auto`: this machine; `cuda`: a GPU host (fp16, bf16, Lamb, NVMe); `cpu`: this CPU's abilities."""
        here = DeviceCaps.detect()
        if name in ("auto", here.name):
            return here
        if name == "cuda":
            return DeviceCaps("cuda", True, True, local=False)
        if name == "cpu":
            import torch
            try:
                fp16 = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
            except Exception:  # noqa: BLE001
                fp16 = False
            return DeviceCaps("cpu", fp16, True, local=False)
        raise ValueError(f"--device {name!r}: use cpu, cuda or auto")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def pipeline_stages_of(config: dict, given: int | None) -> int:
    if given is not None:
        return given
    stages = (config.get("pipeline") or {}).get("stages", 1) if isinstance(config.get("pipeline"), dict) else 1
    return stages if is_int(stages) and stages > 0 else 1


# --- batch ---------------------------------------------------------------------------------------

def batch_problems(config: dict, world_size: int | None, pipeline_stages: int | None) -> list[Problem]:
    """DeepSpeed's batch derivation and assertion, at `world_size` or, without one, at the size a
    complete triple was written for. "auto" members are filled later (HF or bigtrain): not checked."""
    values = {k: config.get(k) for k in BATCH_KEYS}
    problems = [Problem(k, f"={show(v)}: must be a positive integer"
                           f"{' (a JSON number, not a string: ' + repr(k) + ': ' + v + ')' if isinstance(v, str) and v.isdigit() else ''}")
                for k, v in values.items() if v not in (None, "auto") and not (is_int(v) and v > 0)]
    if problems or "auto" in values.values():
        return problems
    total, micro, accum = values.values()
    if total is None and micro is None:
        return [Problem("train_batch_size", "missing: give train_batch_size or train_micro_batch_size_per_gpu "
                                            "(DeepSpeed needs one of them)")]
    nowhere = holds_nowhere(total, micro, accum)
    if nowhere:
        return [nowhere]
    stages = pipeline_stages_of(config, pipeline_stages)
    if world_size is not None:
        problem = Topology(world_size, stages).divisibility_problem(DS_AXES)
        if problem:
            return [Problem("pipeline.stages", problem)]
        topology = topology_of(config, world_size, stages)
        if topology.divisibility_problem(DS_AXES):
            return []  # the split does not divide the world: parallel_problems says so, and no batch holds there
        dp = topology.data
    elif None not in (total, micro, accum):
        return []  # it holds at the data-parallel size it was written for
    else:
        dp = 1
    return _triple_at(total, micro, accum, dp)


def holds_nowhere(total: Any, micro: Any, accum: Any) -> Problem | None:
    """A batch DeepSpeed refuses at every world size: train_batch_size is micro x accum x data-parallel, so it must
    be a multiple of the members given with it. (One written for another world size is fitted, not refused.)"""
    given = [(key, value) for key, value in zip(BATCH_KEYS[1:], (micro, accum)) if value is not None]
    if not (is_int(total) and given and all(is_int(v) and v > 0 for _, v in given)):
        return None
    per_rank = 1
    for _, value in given:
        per_rank *= value
    if total % per_rank == 0:
        return None
    factors = " x ".join(f"{key} {value}" for key, value in given)
    return Problem("train_batch_size", f"={total} is not a multiple of {factors}: no world size fits (DeepSpeed "
                                       f"refuses it at any); set train_batch_size to a multiple of {per_rank}, or "
                                       "leave one of the three out (or \"auto\") for bigtrain to derive")


def _triple_at(total: int | None, micro: int | None, accum: int | None, dp: int) -> list[Problem]:
    """DeepSpeedConfig._set_batch_related_parameters + _batch_assertion at data-parallel size `dp`."""
    if total is not None and micro is not None and accum is None:
        accum = total // micro // dp
    elif total is not None and accum is not None and micro is None:
        micro = total // dp // accum
    elif micro is not None and total is None:
        accum = accum or 1
        total = micro * accum * dp
    elif total is not None and micro is None:
        accum, micro = 1, total // dp
    if micro <= 0 or accum <= 0 or total != micro * accum * dp:
        return [Problem("train_batch_size", f"={total} != train_micro_batch_size_per_gpu {micro} x "
                                            f"gradient_accumulation_steps {accum} x data-parallel size {dp}: set "
                                            "train_batch_size to a multiple of micro x data-parallel, or leave one "
                                            "of the three out (or \"auto\") for bigtrain to derive")]
    return []


# --- layout and device -----------------------------------------------------------------------------

def zero_section(config: dict) -> dict:
    zero = config.get("zero_optimization")
    return zero if isinstance(zero, dict) else {}


def offload_device(zero: dict, key: str) -> str:
    """The offload device DeepSpeed's DeepSpeedZeroConfig settles on (deprecated `cpu_offload` included)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    try:
        section = getattr(DeepSpeedZeroConfig(**zero), key)
    except Exception:  # noqa: BLE001 - an invalid section is reported by the key checks
        section = zero.get(key)
        device = section.get("device", "none") if isinstance(section, dict) else "none"
        return device if device in ("cpu", "nvme") else "none"
    device = getattr(section, "device", "none") if section is not None else "none"
    return str(getattr(device, "value", device))


def layout_lint(config: dict, pipeline_stages: int | None) -> list[Problem]:
    """ZeRO stage x offload x pipeline, worded by bigtrain.config.rules (the one copy of those rules)."""
    zero = zero_section(config)
    stage = zero.get("stage", 0)
    if not is_int(stage):
        return []
    opt, param = offload_device(zero, "offload_optimizer"), offload_device(zero, "offload_param")
    stages = pipeline_stages_of(config, pipeline_stages)
    every = layout_problems(Layout(stage, opt, param, stages), DS_KEYS)
    # What DeepSpeed runs instead of refusing: offload_param below stage 3 and offload_optimizer at stage 0 are
    # ignored; its stage 1-2 optimizer offloads any device but "none" to CPU memory, NVMe included.
    ran = "none" if stage == 0 else "cpu" if opt == "nvme" and stage in (1, 2) else opt
    hard = layout_problems(Layout(stage, ran, param if stage == 3 else "none", stages), DS_KEYS)
    problems = []
    for line in every:
        if line in hard:
            problems.append(Problem("zero_optimization", line))
        else:
            nvme_as_cpu = line.startswith(f"{DS_KEYS.optimizer_device}=nvme") and ran == "cpu"
            why = "DeepSpeed offloads to CPU memory instead" if nvme_as_cpu else "DeepSpeed ignores it"
            problems.append(Problem("zero_optimization", f"{line} ({why} at this stage)", level="warning"))
    return problems


def topology_of(config: dict, world_size: int, pipeline_stages: int | None = None) -> Topology:
    """The split `config` asks for at `world_size` ranks (`pipeline_stages` given on the command line wins)."""
    topology = Topology.of(config, world_size)
    if pipeline_stages is None:
        return topology
    from dataclasses import replace
    return replace(topology, pipeline=pipeline_stages)


def parallel_problems(config: dict, world_size: int | None) -> list[Problem]:
    """Tensor / sequence / expert parallel sizes: combinations DeepSpeed cannot run, and sizes that do not divide
    the world. Without a world size, the sizes are judged at the ranks they are written for (as a complete batch
    triple is): a file with autotp_size 2 is meant for a multiple of 2 ranks."""
    topology = topology_of(config, world_size or 1)
    problems = [Problem("", line) for line in topology.combination_problems(DS_AXES)]
    if world_size is None:
        return problems
    for key, size in ((DS_AXES.tensor, topology.tensor), (DS_AXES.sequence, topology.sequence),
                      (DS_AXES.expert, topology.expert)):
        if size > 1 and world_size % size:
            problems.append(Problem(key, f"={size} needs a multiple of {size} ranks; checked for {world_size} "
                                         "rank(s)"))
    if not any(p.path for p in problems) and topology.divisibility_problem(DS_AXES):
        problems.append(Problem("", topology.divisibility_problem(DS_AXES)))
    return problems or autoep_problems(config, world_size or topology.replica * topology.expert)


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


# --- ZeRO++ and Muon against ZeRO -------------------------------------------------------------------------

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


def _enabled(config: dict, key: str) -> bool:
    section = config.get(key)
    return isinstance(section, dict) and section.get("enabled") is True


def device_problems(config: dict, device: DeviceCaps) -> list[Problem]:
    """Precision, NVMe and GPU-only kernels against the target device."""
    fp16 = _enabled(config, "fp16")
    bf16 = _enabled(config, "bf16") if "bf16" in config else _enabled(config, "bfloat16")
    problems = []
    if fp16 and bf16:
        problems.append(Problem("fp16.enabled", "=true with bf16.enabled=true: DeepSpeed runs one; set one to false"))
    if fp16 and not device.fp16:
        problems.append(Problem("fp16.enabled", f"=true but this {device.name} has no fp16 support: use "
                                                "{\"bf16\": {\"enabled\": true}}, or lint with --device cuda for a GPU host"))
    if bf16 and not device.bf16:
        problems.append(Problem("bf16.enabled", f"=true but this {device.name} has no bf16 support: use fp16 or fp32"))
    zero = zero_section(config)
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key)
        if not isinstance(section, dict) or section.get("device") != "nvme":
            continue
        if device.name == "cpu":
            problems.append(Problem(f"zero_optimization.{key}.device", "=\"nvme\": NVMe offload (async I/O) is a GPU-host "
                                                                      "feature; offload to cpu here, or lint with --device cuda"))
        path = section.get("nvme_path")
        if device.local and (not isinstance(path, str) or not os.path.isdir(path)):
            problems.append(Problem(f"zero_optimization.{key}.nvme_path", f"={show(path)} does not exist on this "
                                                                         "host: point it at a directory on an NVMe drive"))
    return problems


# --- DeepSpeed's own parser, the last gate ------------------------------------------------------------

def parser_problems(config: dict, world_size: int | None, pipeline_stages: int | None) -> list[Problem]:
    """DeepSpeed's own config parser as the last gate (HF "auto" stand-ins in place)."""
    body = _without_hf_auto(config)
    if world_size is not None:
        dp = max(1, world_size // topology_of(config, world_size, pipeline_stages_of(config, pipeline_stages)).replica)
    else:
        total, micro, accum = (body.get(k) for k in BATCH_KEYS)
        dp = total // (micro * accum) if all(is_int(v) and v > 0 for v in (total, micro, accum)) \
            and total % (micro * accum) == 0 else 1
    refusal = schema.parser_refusal(body, dp)
    return [Problem("", f"DeepSpeed's config parser refuses it: {refusal}")] if refusal else []


def _without_hf_auto(config: dict) -> dict:
    """A copy with "auto" where the HF integration fills it replaced, so the parser sees a number."""
    body = copy.deepcopy(config)
    if any(body.get(k) == "auto" for k in BATCH_KEYS):
        for key in BATCH_KEYS:
            if body.get(key) == "auto":
                del body[key]
        if not any(is_int(body.get(k)) for k in BATCH_KEYS[:2]):
            body["train_micro_batch_size_per_gpu"] = 1
            body.pop("train_batch_size", None)
    if body.get("gradient_clipping") == "auto":
        body["gradient_clipping"] = 1.0
    return body


def show(value: Any) -> str:
    import json
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def first_line(err: BaseException) -> str:
    return next((ln.strip() for ln in str(err).splitlines() if ln.strip()), type(err).__name__)
