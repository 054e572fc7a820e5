"""Which run-config field each DeepSpeed key carries, in both directions (the names: `keys.py`).

`build_ds_config` (generate.py) writes a run config into DeepSpeed keys; this module reads
them back: `stated` is what a DeepSpeed dict says explicitly (a key present and not "auto"),
`absorb` is the whole run config a complete DeepSpeed dict trains with (keys it leaves out
read as DeepSpeed's own defaults), and `LINKS` names the keys that carry each field, so that
a field decided elsewhere (`--set`) can be written into a user's JSON.
"""
from __future__ import annotations

import copy
import inspect
from typing import Any

from bigtrain.config.load import from_dict, set_dotted_value, to_dict
from bigtrain.config.run_config import RunConfig
from bigtrain.ds.keys import BATCH_FIELDS, MUON_FIELDS, OPTIMIZER_TYPES, PARALLEL_KEYS, SCHEDULE_KINDS, ZERO_KEYS
Z, OPT, SCHED = "zero_optimization", "optimizer", "scheduler"

LINKS: dict[str, tuple[tuple[str, ...], ...]] = {
    **{field: ((Z, key),) for field, key in ZERO_KEYS.items()},
    "zero.stage": ((Z, "stage"),),
    "offload.optimizer": ((Z, "offload_optimizer"), ("aio",)),
    "offload.param": ((Z, "offload_param"), ("aio",)),
    "offload.nvme_path": ((Z, "offload_optimizer", "nvme_path"), (Z, "offload_param", "nvme_path")),
    "offload.pin_memory": ((Z, "offload_optimizer", "pin_memory"), (Z, "offload_param", "pin_memory")),
    "precision": (("bf16",), ("fp16",), ("bfloat16",)),
    "optimizer.name": ((OPT, "type"),),
    "optimizer.lr": ((OPT, "params", "lr"), (SCHED, "params", "warmup_max_lr"), (SCHED, "params", "warmup_min_lr")),
    "optimizer.betas": ((OPT, "params", "betas"),),
    "optimizer.eps": ((OPT, "params", "eps"),),
    "optimizer.weight_decay": ((OPT, "params", "weight_decay"),),
    "optimizer.torch_adam": ((OPT, "params", "torch_adam"),),
    **{field: ((OPT, "params", key),) for field, key in MUON_FIELDS.items()},
    "optimizer.grad_clip": (("gradient_clipping",),),
    "schedule.kind": ((SCHED,),),
    "schedule.warmup_steps": ((SCHED, "params", "warmup_num_steps"),),
    "schedule.min_lr_ratio": ((SCHED, "params", "warmup_min_ratio"), (SCHED, "params", "cos_min_ratio"),
                              (SCHED, "params", "warmup_min_lr")),
    "activation_checkpointing.enabled": (("activation_checkpointing",), ("pipeline", "activation_checkpoint_interval")),
    "activation_checkpointing.every_n_layers": (("pipeline", "activation_checkpoint_interval"),),
    "activation_checkpointing.partition_activations": (("activation_checkpointing", "partition_activations"),),
    "activation_checkpointing.cpu_checkpointing": (("activation_checkpointing", "cpu_checkpointing"),),
    "pipeline.stages": (("pipeline", "stages"),),
    **{field: (path,) for field, path in PARALLEL_KEYS.items()},
    "pipeline.partition_method": (("pipeline", "partition"),),
}


def stated(config: dict) -> dict[str, Any]:
    """Run-config field -> value, for what `config` says explicitly (a key present, not "auto")."""
    out: dict[str, Any] = {}
    out.update(_zero_stated(config.get(Z)))
    out.update(_precision_stated(config))
    out.update(_optimizer_stated(config))
    out.update(_schedule_stated(config.get(SCHED)))
    ac = config.get("activation_checkpointing")
    if isinstance(ac, dict):
        out["activation_checkpointing.enabled"] = True
        for key in ("partition_activations", "cpu_checkpointing"):
            _take(out, f"activation_checkpointing.{key}", ac, key)
    pipe = config.get("pipeline")
    if isinstance(pipe, dict):
        _take(out, "pipeline.stages", pipe, "stages")
        _take(out, "pipeline.partition_method", pipe, "partition")
        interval = pipe.get("activation_checkpoint_interval")
        if isinstance(interval, int) and interval > 0:
            out.update({"activation_checkpointing.enabled": True, "activation_checkpointing.every_n_layers": interval})
    for field, key in BATCH_FIELDS.items():
        _take(out, field, config, key)
    for field, path in PARALLEL_KEYS.items():
        value = get_path(config, path)
        if isinstance(value, int) and not isinstance(value, bool) and (path[0] != "expert_parallel" or (
                config["expert_parallel"].get("enabled") is True)):
            out[field] = value
    return out


def absorb(run: RunConfig, config: dict) -> RunConfig:
    """The run config that `config`, a complete DeepSpeed dict, trains with: every field it carries,
    keys it leaves out read as DeepSpeed's defaults (ZeRO knobs, scheduler parameters). A value the run
    config cannot hold (`with_json_fields`) keeps `run`'s; `config` is the record of what ran."""
    values = stated(config)
    zero = config.get(Z) if isinstance(config.get(Z), dict) else {}
    values.update({k: v for k, v in zero_effective(zero).items() if k not in values})
    values.update({k: v for k, v in _schedule_defaults(config.get(SCHED)).items() if k not in values})
    values.setdefault("activation_checkpointing.enabled", False)
    values.setdefault("pipeline.stages", 1)
    for field in PARALLEL_KEYS:
        values.setdefault(field, 1)
    return with_json_fields(run, values)[0]


def with_json_fields(run: RunConfig, values: dict[str, Any]) -> tuple[RunConfig, dict[str, str]]:
    """`run` with the fields a DeepSpeed JSON gives, and {field: why} for those the run config cannot hold.

    A JSON value is DeepSpeed's to judge (the lint does, with DeepSpeed's own models and parser); the run
    config's bounds are stricter in places (sub_group_size 0, lr 0, a negative gradient_clipping,
    cpu_checkpointing without partition_activations all run in DeepSpeed). Such a field keeps `run`'s
    value: the JSON's still runs, and the caller says that the record differs.
    """
    try:
        return with_fields(run, values), {}
    except ValueError:
        pass
    kept: dict[str, Any] = {}
    refused: dict[str, str] = {}
    pending = list(values)
    while pending:  # a field refused only beside another one's old value is taken once that one moved
        progress, retry = False, []
        for field in pending:
            try:
                with_fields(run, {**kept, field: values[field]})
            except ValueError as err:
                retry.append(field)
                refused[field] = next((ln for ln in str(err).splitlines() if ln.strip()), type(err).__name__)
            else:
                kept[field] = values[field]
                refused.pop(field, None)
                progress = True
        if not progress:
            break
        pending = retry
    return with_fields(run, kept), refused


def json_key(field: str, config: dict) -> str:
    """The key path that carries run-config `field` in `config` (dotted), as the user wrote it."""
    for path in LINKS.get(field, ()):
        for spelled in (path, (*path[:-1], path[-1].removeprefix("stage3_"))):
            if get_path(config, spelled) is not _MISSING:
                return ".".join(spelled)
    return BATCH_FIELDS.get(field, field)


def with_fields(run: RunConfig, values: dict[str, Any]) -> RunConfig:
    """`run` with dotted fields replaced, built (and checked) like any run config."""
    data = to_dict(run)
    for field, value in values.items():
        set_dotted_value(data, field, list(value) if isinstance(value, tuple) else value)
    return from_dict(RunConfig, data)


def field_value(run: RunConfig, field: str) -> Any:
    node: Any = run
    for part in field.split("."):
        node = getattr(node, part)
    return list(node) if isinstance(node, tuple) else node


def zero_effective(zero: dict) -> dict[str, Any]:
    """ZeRO fields as DeepSpeed's own config model reads `zero` (its defaults for what is left out)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    try:
        model = DeepSpeedZeroConfig(**{k: v for k, v in zero.items() if v != "auto"})
    except Exception:  # noqa: BLE001 -- an invalid section is the lint's to report, with its own message
        return {}
    out = {field: getattr(model, key.removeprefix("stage3_")) for field, key in ZERO_KEYS.items()}
    out["zero.stage"] = int(model.stage)
    return {k: v for k, v in out.items() if v is not None}


def get_path(config: dict, path: tuple[str, ...]) -> Any:
    node: Any = config
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return _MISSING
        node = node[key]
    return node


def set_path(config: dict, path: tuple[str, ...], value: Any) -> None:
    """Set (or, with value _MISSING, remove) `path` in `config`, creating parent sections."""
    node = config
    for key in path[:-1]:
        if not isinstance(node.get(key), dict):
            if value is _MISSING:
                return
            node[key] = {}
        node = node[key]
    if value is _MISSING:
        node.pop(path[-1], None)
    else:
        node[path[-1]] = copy.deepcopy(value)


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING: Any = _Missing()
MISSING = _MISSING


def _take(out: dict, field: str, section: Any, key: str) -> None:
    if isinstance(section, dict) and key in section and section[key] != "auto":
        out[field] = section[key]


def _zero_stated(zero: Any) -> dict[str, Any]:
    if not isinstance(zero, dict):
        return {}
    out: dict[str, Any] = {}
    if zero.get("stage", 0) != "auto":
        out["zero.stage"] = zero.get("stage", 0)
    for field, key in ZERO_KEYS.items():
        _take(out, field, zero, key)
        _take(out, field, zero, key.removeprefix("stage3_"))
    stage = zero.get("stage", 0)
    for kind in ("optimizer", "param"):
        section = zero.get(f"offload_{kind}")
        device = section.get("device", "none") if isinstance(section, dict) else "none"
        # DeepSpeed runs offload_param below stage 3 and offload_optimizer at stage 0 without the offload, and an
        # NVMe optimizer offload at stage 1-2 as CPU offload (the lint warns, naming the JSON's key): the run
        # config records what runs, not what its own rules refuse.
        if isinstance(stage, int) and (stage != 3 if kind == "param" else stage == 0):
            device = "none"
        elif kind == "optimizer" and device == "nvme" and stage in (1, 2):
            device = "cpu"
        if device != "auto":
            out[f"offload.{kind}"] = device if device is not None else "none"
        _take(out, "offload.nvme_path", section, "nvme_path")
        _take(out, "offload.pin_memory", section, "pin_memory")
    if out.get("offload.nvme_path") is None:
        out.pop("offload.nvme_path", None)
    return out


def _precision_stated(config: dict) -> dict[str, Any]:
    flags = {}
    for section in ("bf16", "bfloat16", "fp16"):
        value = config.get(section)
        if isinstance(value, dict) and isinstance(value.get("enabled", False), bool):
            flags[section] = value.get("enabled", False)
    if not flags:
        return {}
    if flags.get("bf16") or flags.get("bfloat16"):
        return {"precision": "bf16"}
    return {"precision": "fp16" if flags.get("fp16") else "fp32"}


def _optimizer_stated(config: dict) -> dict[str, Any]:
    out: dict[str, Any] = {}
    _take(out, "optimizer.grad_clip", config, "gradient_clipping")
    section = config.get(OPT)
    if not isinstance(section, dict):
        return out
    names = {v.lower(): k for k, v in OPTIMIZER_TYPES.items()}
    name = names.get(str(section.get("type", "")).lower())
    if name:
        out["optimizer.name"] = name
    params = section.get("params")
    for key in ("lr", "betas", "eps", "weight_decay", "torch_adam"):
        _take(out, f"optimizer.{key}", params, key)
    if name == "muon":
        for field, key in MUON_FIELDS.items():
            _take(out, field, params, key)
    return out


def _schedule_stated(section: Any) -> dict[str, Any]:
    if not isinstance(section, dict) or section.get("type") not in SCHEDULE_KINDS:
        return {}
    kind = SCHEDULE_KINDS[section["type"]]
    params = section.get("params") if isinstance(section.get("params"), dict) else {}
    out: dict[str, Any] = {"schedule.kind": kind}
    _take(out, "schedule.warmup_steps", params, "warmup_num_steps")
    if kind == "cosine":
        if params.get("warmup_min_ratio") == 1.0 and _number(params.get("cos_min_ratio")):  # starts at the peak
            out.update({"schedule.warmup_steps": 0, "schedule.min_lr_ratio": params["cos_min_ratio"]})
        else:
            _take(out, "schedule.min_lr_ratio", params, "warmup_min_ratio")
        return out
    peak, low = params.get("warmup_max_lr"), params.get("warmup_min_lr")
    if _number(peak):  # these schedules set the learning rate themselves: their peak is the run's lr
        out["optimizer.lr"] = peak
        if kind == "constant" and _number(low) and low == peak:  # a warm-up from the peak to the peak: none
            out["schedule.warmup_steps"] = 0
        elif _number(low) and peak > 0 and 0 <= low <= peak:
            out["schedule.min_lr_ratio"] = low / peak
    return out


def _schedule_defaults(section: Any) -> dict[str, Any]:
    """DeepSpeed's defaults for the scheduler parameters a section leaves out."""
    if not isinstance(section, dict) or section.get("type") not in SCHEDULE_KINDS:
        return {}
    from deepspeed.runtime import lr_schedules
    signature = inspect.signature(getattr(lr_schedules, section["type"]).__init__).parameters
    out = {"schedule.warmup_steps": signature["warmup_num_steps"].default}
    if section["type"] == "WarmupCosineLR":
        out["schedule.min_lr_ratio"] = signature["warmup_min_ratio"].default
    return out


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
