"""A user's DeepSpeed JSON -> a checked config for the real world size, plus the run config it implies.

Order: read -> unknown keys -> resolve "auto" (HF Trainer style) from the run config -> batch
triple for the real world size -> semantic checks -> DeepSpeed's own parser. Any problem raises
LintError before a rank trains.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bigtrain.ds.batch import BatchTriple, data_parallel_size, rescale_for_world, solve_batch
from bigtrain.config.run_config import (ActivationCheckpointConfig, BatchConfig, OffloadConfig, OptimizerConfig, PipelineConfig,
                             RunConfig)
from bigtrain.ds.generate import OPTIMIZER_TYPES, build_ds_config
from bigtrain.ds.lint import (BATCH_KEYS, DeviceCaps, LintError, read_ds_json, semantic_problems, unknown_keys,
                              validate_with_deepspeed)


@dataclass
class Resolved:
    ds_config: dict
    run: RunConfig  # the run config with the JSON's settings absorbed
    notes: list[str]  # what was changed and why, for the log


def resolve_ds_file(path: str | Path, run: RunConfig, world_size: int | None,
                    pipeline_stages: int | None = None, device: DeviceCaps | None = None,
                    fit_world: bool = False) -> Resolved:
    """Lint and resolve a user's DeepSpeed JSON.

    `fit_world=True` (the runner) recomputes a triple written for another world size; the
    `lint` command leaves it False so an inconsistent triple is reported instead.
    """
    return resolve_ds_dict(read_ds_json(path), run, world_size, pipeline_stages, device, fit_world)


def resolve_ds_dict(user: dict, run: RunConfig, world_size: int | None, pipeline_stages: int | None = None,
                    device: DeviceCaps | None = None, fit_world: bool = False) -> Resolved:
    device = device or DeviceCaps.detect()
    problems = unknown_keys(user)
    if problems:
        raise LintError(problems)
    config = resolve_auto(user, run, world_size, pipeline_stages)
    notes: list[str] = []
    if fit_world and world_size is not None:
        notes += _fit_batch_to_world(config, world_size, _stages(config, pipeline_stages))
    problems = semantic_problems(config, world_size, pipeline_stages, device)
    if not problems:
        dp = data_parallel_size(world_size, _stages(config, pipeline_stages)) if world_size else _implied_dp(config)
        problems = validate_with_deepspeed(config, dp)
    if problems:
        raise LintError(problems)
    return Resolved(config, absorb(run, config), notes)


def resolve_auto(user: dict, run: RunConfig, world_size: int | None, pipeline_stages: int | None) -> dict:
    """Replace HF-style "auto" values with the run config's settings; any other "auto" is an error."""
    config = copy.deepcopy(user)
    _resolve_batch_auto(config, run, world_size, _stages(config, pipeline_stages))
    opt = run.optimizer
    precision = run.precision
    if precision == "auto":
        from bigtrain.distributed.device import default_precision
        precision = default_precision()
    values = {
        ("gradient_clipping",): opt.grad_clip,
        ("fp16", "enabled"): precision == "fp16",
        ("bf16", "enabled"): precision == "bf16",
        ("optimizer", "params", "lr"): opt.lr,
        ("optimizer", "params", "betas"): list(opt.betas),
        ("optimizer", "params", "eps"): opt.eps,
        ("optimizer", "params", "weight_decay"): opt.weight_decay,
        ("scheduler", "params", "warmup_min_lr"): opt.lr * run.schedule.min_lr_ratio,
        ("scheduler", "params", "warmup_max_lr"): opt.lr,
        ("scheduler", "params", "warmup_num_steps"): min(run.schedule.warmup_steps, run.train.steps),
        ("scheduler", "params", "total_num_steps"): run.train.steps,
        ("zero_optimization", "reduce_bucket_size"): run.zero.reduce_bucket_size,
        ("zero_optimization", "stage3_prefetch_bucket_size"): run.zero.prefetch_bucket_size,
        ("zero_optimization", "stage3_param_persistence_threshold"): run.zero.param_persistence_threshold,
        ("zero_optimization", "stage3_max_live_parameters"): run.zero.max_live_parameters,
        ("zero_optimization", "stage3_max_reuse_distance"): run.zero.max_reuse_distance,
        ("zero_optimization", "sub_group_size"): run.zero.sub_group_size,
    }
    for path, value in values.items():
        node = _parent(config, path)
        if node is not None and node.get(path[-1]) == "auto":
            node[path[-1]] = value
    left = list(_auto_paths(config))
    if left:
        raise LintError([f"{p}=\"auto\": bigtrain cannot derive this key; give it a value" for p in left])
    return config


def _resolve_batch_auto(config: dict, run: RunConfig, world_size: int | None, stages: int) -> None:
    """Missing or "auto" batch keys come from the run config; two known members fix the third."""
    given = [None if config.get(k) in (None, "auto") else config[k] for k in BATCH_KEYS]
    if None not in given:
        return
    if world_size is None:
        raise LintError(['batch sizes that are "auto" or missing need the world size; pass --world-size N'])
    defaults = (run.batch.global_batch, run.batch.micro_batch, run.batch.grad_accum)
    for i in (1, 2, 0):  # fill from the run config, micro-batch first, until two are known
        if sum(g is not None for g in given) >= 2:
            break
        if given[i] is None:
            given[i] = defaults[i]
    triple = solve_batch(*given, data_parallel_size(world_size, stages))
    config.update(zip(BATCH_KEYS, (triple.global_batch, triple.micro_batch, triple.grad_accum)))


def _fit_batch_to_world(config: dict, world_size: int, stages: int) -> list[str]:
    values = [config.get(k) for k in BATCH_KEYS]
    if not all(isinstance(v, int) and v > 0 for v in values):
        return []
    total, micro, accum = values
    written_dp = total // (micro * accum) if total % (micro * accum) == 0 else None
    dp = data_parallel_size(world_size, stages)
    if written_dp is None or written_dp == dp:
        return []
    new, note = rescale_for_world(BatchTriple(total, micro, accum, written_dp), dp)
    config.update(zip(BATCH_KEYS, (new.global_batch, new.micro_batch, new.grad_accum)))
    return [note]


def absorb(run: RunConfig, config: dict) -> RunConfig:
    """The run config with the settings this DeepSpeed config decides (stage, precision, batch, ...)."""
    zero = config.get("zero_optimization") or {}
    precision = "bf16" if _on(config, "bf16") or _on(config, "bfloat16") else "fp16" if _on(config, "fp16") else "fp32"
    pipe = config.get("pipeline") or {}
    interval = pipe.get("activation_checkpoint_interval", 0)
    ac_on = "activation_checkpointing" in config or (isinstance(interval, int) and interval > 0)
    ac = replace(run.activation_checkpointing, enabled=ac_on,
                 every_n_layers=interval if isinstance(interval, int) and interval > 0 else 1)
    stages = pipe.get("stages", 1)
    return replace(
        run, precision=precision,
        zero=replace(run.zero, stage=int(zero.get("stage", 0))),
        offload=OffloadConfig(optimizer=_device(zero.get("offload_optimizer")), param=_device(zero.get("offload_param")),
                              nvme_path=_nvme_path(zero, run.offload.nvme_path)),
        batch=BatchConfig(*(config[k] for k in BATCH_KEYS)) if all(k in config for k in BATCH_KEYS) else run.batch,
        optimizer=_absorb_optimizer(run.optimizer, config),
        activation_checkpointing=ac,
        pipeline=PipelineConfig(stages=stages if isinstance(stages, int) else 1,
                                partition_method=str(pipe.get("partition", run.pipeline.partition_method))),
    )


def _absorb_optimizer(opt: OptimizerConfig, config: dict) -> OptimizerConfig:
    section = config.get("optimizer") or {}
    names = {v.lower(): k for k, v in OPTIMIZER_TYPES.items()}
    name = names.get(str(section.get("type", "")).lower(), opt.name)
    params = section.get("params") or {}
    return replace(opt, name=name, lr=float(params.get("lr", opt.lr)),
                   grad_clip=float(config.get("gradient_clipping", opt.grad_clip)),
                   weight_decay=float(params.get("weight_decay", opt.weight_decay)))


def generated_or_user(run: RunConfig, world_size: int, ds_path: str | None,
                      device: DeviceCaps | None = None) -> Resolved:
    """The runner's entry: the user's JSON when given (fitted to the world size), else generated."""
    if ds_path:
        return resolve_ds_file(ds_path, run, world_size, device=device, fit_world=True)
    return resolve_ds_dict(build_ds_config(run, world_size), run, world_size, device=device)


def _implied_dp(config: dict) -> int | None:
    """The data-parallel size a complete triple was written for (lint without --world-size)."""
    total, micro, accum = (config.get(k) for k in BATCH_KEYS)
    if all(isinstance(v, int) and v > 0 for v in (total, micro, accum)) and total % (micro * accum) == 0:
        return total // (micro * accum)
    return None


def _on(config: dict, key: str) -> bool:
    section = config.get(key)
    return isinstance(section, dict) and section.get("enabled") is True


def _device(section: Any) -> str:
    return section.get("device", "none") if isinstance(section, dict) else "none"


def _nvme_path(zero: dict, default: str) -> str:
    for key in ("offload_param", "offload_optimizer"):
        section = zero.get(key)
        if isinstance(section, dict) and section.get("nvme_path"):
            return str(section["nvme_path"])
    return default


def _stages(config: dict, given: int | None) -> int:
    if given is not None:
        return given
    stages = (config.get("pipeline") or {}).get("stages", 1)
    return stages if isinstance(stages, int) and stages > 0 else 1


def _parent(config: dict, path: tuple[str, ...]) -> dict | None:
    node: Any = config
    for key in path[:-1]:
        node = node.get(key) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


def _auto_paths(node: Any, prefix: str = ""):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _auto_paths(value, f"{prefix}{key}.")
    elif node == "auto":
        yield prefix.rstrip(".")
