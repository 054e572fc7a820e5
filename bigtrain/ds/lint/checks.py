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
from bigtrain.config.topology import DS_AXES, Topology

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
    the world (AutoEP's own validation follows where these hold: `levers.split_problems`). Without a world size, the sizes are judged at the ranks they are written for (as a complete batch
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
        if path is None:  # DeepSpeed's swapper joins paths onto it inside initialize, on any host
            problems.append(Problem(f"zero_optimization.{key}.nvme_path", "is missing: device \"nvme\" needs a "
                                                                         "directory on an NVMe drive to swap to"))
        elif device.local and (not isinstance(path, str) or not os.path.isdir(path)):
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
