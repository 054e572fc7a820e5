"""Lint a DeepSpeed config before any rank trains: one line per problem, naming the key and the fix."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bigtrain.config.load import unknown_key_message
from bigtrain.ds.schema import (DICT_SECTIONS, TOP_LEVEL, model_keys, optimizer_param_keys, pydantic_sections,
                                scheduler_param_keys)

NO_CPU_KERNEL = {"lamb", "onebitadam", "zerooneadam", "onebitlamb"}
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


class LintError(ValueError):
    """One or more problems in a DeepSpeed config; `problems` holds one line each."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class DeviceCaps:
    name: str  # "cpu", "cuda", ...
    fp16: bool
    bf16: bool

    @staticmethod
    def detect() -> "DeviceCaps":
        from deepspeed.accelerator import get_accelerator
        acc = get_accelerator()
        return DeviceCaps(acc.device_name(), bool(acc.is_fp16_supported()), bool(acc.is_bf16_supported()))


def read_ds_json(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise LintError([f"{path}: no such file; pass a DeepSpeed JSON such as ds_configs/zero2.json"])
    text = path.read_text()
    if not text.strip():
        raise LintError([f"{path}: the file is empty; a DeepSpeed config is a JSON object like {{\"train_batch_size\": 8}}"])
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise LintError([f"{path}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno})"]) from None
    if not isinstance(data, dict):
        raise LintError([f"{path}: the top level must be a JSON object, got {type(data).__name__}"])
    return data


def unknown_keys(config: dict) -> list[str]:
    """Every key DeepSpeed would not read, at any level, with a did-you-mean."""
    problems = [unknown_key_message(k, k, sorted(TOP_LEVEL)) for k in config if k not in TOP_LEVEL]
    models = pydantic_sections()
    for section, value in config.items():
        if not isinstance(value, dict):
            continue
        if section in models:
            problems += _unknown_in_model(value, models[section], section)
        elif section in DICT_SECTIONS:
            problems += _unknown_in(value, DICT_SECTIONS[section], section)
    problems += _unknown_params(config, "optimizer", optimizer_param_keys)
    problems += _unknown_params(config, "scheduler", scheduler_param_keys)
    return problems


def _unknown_in(section: dict, allowed: set[str], path: str) -> list[str]:
    return [unknown_key_message(f"{path}.{k}", k, sorted(allowed)) for k in section if k not in allowed]


def _unknown_in_model(section: dict, model: Any, path: str) -> list[str]:
    allowed = model_keys(model)
    problems = _unknown_in(section, set(allowed), path)
    for key, value in section.items():
        nested = allowed.get(key)
        if nested is not None and isinstance(value, dict):
            problems += _unknown_in_model(value, nested, f"{path}.{key}")
    return problems


def _unknown_params(config: dict, section: str, keys_for: Any) -> list[str]:
    body = config.get(section)
    if not isinstance(body, dict) or not isinstance(body.get("params"), dict):
        return []
    type_name = str(body.get("type", ""))
    allowed = keys_for(type_name)
    if allowed is None:
        if section == "scheduler":
            from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES
            return [f"{section}.type={type_name!r} is not a DeepSpeed scheduler; use one of "
                    f"{', '.join(VALID_LR_SCHEDULES)}"]
        return []
    return _unknown_in(body["params"], allowed, f"{section}.params")


def semantic_problems(config: dict, world_size: int | None, pipeline_stages: int | None,
                      device: DeviceCaps) -> list[str]:
    """Combinations DeepSpeed rejects late (or never), checked on a config with no "auto" left."""
    problems = _batch_problems(config, world_size, _pipeline_stages(config, pipeline_stages))
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    stages = _pipeline_stages(config, pipeline_stages)
    if stages > 1 and isinstance(stage, int) and stage >= 2:
        problems.append(f"zero_optimization.stage={stage} with {stages} pipeline stages: DeepSpeed pipelines "
                        "support ZeRO 0-1 only; set zero_optimization.stage to 1 or drop the pipeline")
    problems += _offload_problems(zero if isinstance(zero, dict) else {}, stage)
    problems += _precision_problems(config, device)
    opt_type = str((config.get("optimizer") or {}).get("type", "")).lower()
    if device.name == "cpu" and opt_type in NO_CPU_KERNEL:
        problems.append(f"optimizer.type={config['optimizer']['type']!r} has no CPU kernel (GPU only); "
                        "use AdamW on this machine, or run on a GPU host")
    return problems


def _pipeline_stages(config: dict, given: int | None) -> int:
    if given is not None:
        return given
    stages = (config.get("pipeline") or {}).get("stages", 1)
    return stages if isinstance(stages, int) else 1


def _batch_problems(config: dict, world_size: int | None, stages: int) -> list[str]:
    problems = []
    for key in BATCH_KEYS:
        value = config.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            problems.append(f"{key}={value!r}: must be a positive integer")
    if problems or world_size is None or not all(isinstance(config.get(k), int) for k in BATCH_KEYS):
        return problems
    if world_size % stages:
        return [f"world size {world_size} is not divisible by {stages} pipeline stages"]
    dp = world_size // stages
    total, micro, accum = (config[k] for k in BATCH_KEYS)
    if total != micro * accum * dp:
        problems.append(
            f"train_batch_size={total} != train_micro_batch_size_per_gpu {micro} x gradient_accumulation_steps "
            f"{accum} x data-parallel size {dp} (= {micro * accum * dp}); set train_batch_size to "
            f"{micro * accum * dp}, or set one of the three to \"auto\" and let bigtrain derive it")
    return problems


def _offload_problems(zero: dict, stage: Any) -> list[str]:
    problems = []
    for key in ("offload_param", "offload_optimizer"):
        section = zero.get(key)
        if not isinstance(section, dict) or section.get("device", "none") == "none":
            continue
        device = section.get("device")
        if key == "offload_param" and stage != 3:
            problems.append(f"zero_optimization.offload_param needs stage 3 (got stage {stage}); set "
                            "zero_optimization.stage to 3 or remove offload_param")
        if key == "offload_optimizer" and stage == 0:
            problems.append("zero_optimization.offload_optimizer needs stage 1-3 (got stage 0); raise the stage")
        if device == "nvme":
            if stage != 3:
                problems.append(f"zero_optimization.{key}.device=nvme needs stage 3 (ZeRO-Infinity), got "
                                f"stage {stage}; set stage 3 or offload to cpu")
            path = section.get("nvme_path")
            if not path or not os.path.isdir(path):
                problems.append(f"zero_optimization.{key}.nvme_path={path!r} does not exist on this host; "
                                "point it at a directory on an NVMe drive")
    return problems


def _precision_problems(config: dict, device: DeviceCaps) -> list[str]:
    fp16 = _enabled(config.get("fp16"))
    bf16 = _enabled(config.get("bf16")) or _enabled(config.get("bfloat16"))
    problems = []
    if fp16 and bf16:
        problems.append("fp16.enabled and bf16.enabled are both true; enable one (bf16 where the device has it)")
    if fp16 and not device.fp16:
        problems.append(f"fp16.enabled=true but this {device.name} device has no fp16 support; "
                        "use bf16 or fp32 (set fp16.enabled to false)")
    if bf16 and not device.bf16:
        problems.append(f"bf16.enabled=true but this {device.name} device has no bf16 support; use fp16 or fp32")
    return problems


def _enabled(section: Any) -> bool:
    return isinstance(section, dict) and section.get("enabled") is True


def validate_with_deepspeed(config: dict, dp_size: int | None) -> list[str]:
    """Last gate: DeepSpeed's own parser (pydantic value checks, batch assertions)."""
    from unittest import mock

    from deepspeed.runtime import config as ds_runtime_config
    try:
        # DeepSpeedConfig asks the (absent) process group for the rank and then falls back to
        # world size 1; answering rank 0 makes it take the data-parallel size from our stand-in.
        with mock.patch.object(ds_runtime_config.dist, "get_rank", return_value=0):
            ds_runtime_config.DeepSpeedConfig(config, mpu=_FixedWorld(dp_size or 1))
    except Exception as err:  # DeepSpeed raises assertions, ValidationError, ValueError...
        first = str(err).strip().splitlines()
        return [f"DeepSpeed rejects the config: {first[0] if first else type(err).__name__}"]
    return []


class _FixedWorld:
    """A stand-in model-parallel unit so DeepSpeedConfig needs no process group to check the batch."""

    def __init__(self, dp: int):
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1
