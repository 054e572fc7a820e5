"""The checks `deepspeed.initialize` makes beyond the config's keys: batch, layout, device, optimizer, scheduler.

Each returns `Problem`s (one line each) instead of raising, so `bigtrain.ds.lint` reports them all
in one pass. Optimizers and schedulers are looked up the way DeepSpeedEngine does and checked by
constructing them (torch classes, DeepSpeed's schedulers on a dummy optimizer) or by binding
DeepSpeed's op classes' signatures (whose kernels may need a GPU to load).
"""
from __future__ import annotations

import contextlib
import copy
import difflib
import inspect
import os
from dataclasses import dataclass
from typing import Any

from bigtrain.config.rules import DS_KEYS, Layout, divisibility_problem, layout_problems
from bigtrain.ds import schema

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
GPU_ONLY_OPTIMIZERS = ("lamb",)  # FusedLamb: a CUDA kernel only
# What the HF integration puts where a file says "auto" (TrainingArguments defaults), for the
# constructor checks below; bigtrain's own fill comes from the run config before lint runs.
HF_STANDINS = {"lr": 5e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "warmup_min_lr": 0,
               "warmup_max_lr": 5e-5, "warmup_num_steps": 1}


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


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def pipeline_stages_of(config: dict, given: int | None) -> int:
    if given is not None:
        return given
    stages = (config.get("pipeline") or {}).get("stages", 1) if isinstance(config.get("pipeline"), dict) else 1
    return stages if _int(stages) and stages > 0 else 1


# --- batch ---------------------------------------------------------------------------------------

def batch_problems(config: dict, world_size: int | None, pipeline_stages: int | None) -> list[Problem]:
    """DeepSpeed's batch derivation and assertion, at `world_size` or, without one, at the size a
    complete triple was written for. "auto" members are filled later (HF or bigtrain): not checked."""
    values = {k: config.get(k) for k in BATCH_KEYS}
    problems = [Problem(k, f"={_show(v)}: must be a positive integer"
                           f"{' (a JSON number, not a string: ' + repr(k) + ': ' + v + ')' if isinstance(v, str) and v.isdigit() else ''}")
                for k, v in values.items() if v not in (None, "auto") and not (_int(v) and v > 0)]
    if problems or "auto" in values.values():
        return problems
    total, micro, accum = values.values()
    if total is None and micro is None:
        return [Problem("train_batch_size", "missing: give train_batch_size or train_micro_batch_size_per_gpu "
                                            "(DeepSpeed needs one of them)")]
    stages = pipeline_stages_of(config, pipeline_stages)
    if world_size is not None:
        problem = divisibility_problem(world_size, stages)
        if problem:
            return [Problem("pipeline.stages", problem)]
        dp = world_size // stages
    elif None not in (total, micro, accum):
        if total % (micro * accum):
            return [Problem("train_batch_size", f"={total} is not a multiple of train_micro_batch_size_per_gpu {micro} "
                                                f"x gradient_accumulation_steps {accum}: no world size fits; set "
                                                f"train_batch_size to a multiple of {micro * accum}")]
        return []
    else:
        dp = 1
    return _triple_at(total, micro, accum, dp)


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

def _zero(config: dict) -> dict:
    zero = config.get("zero_optimization")
    return zero if isinstance(zero, dict) else {}


def _device_of(zero: dict, key: str) -> str:
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
    zero = _zero(config)
    stage = zero.get("stage", 0)
    if not _int(stage):
        return []
    opt, param = _device_of(zero, "offload_optimizer"), _device_of(zero, "offload_param")
    stages = pipeline_stages_of(config, pipeline_stages)
    every = layout_problems(Layout(stage, opt, param, stages), DS_KEYS)
    # DeepSpeed runs these, ignoring the offload: offload_param below stage 3, offload_optimizer at stage 0.
    hard = layout_problems(Layout(stage, "none" if stage == 0 else opt, param if stage == 3 else "none", stages),
                           DS_KEYS)
    return [Problem("zero_optimization", line if line in hard else f"{line} (DeepSpeed ignores it at this stage)",
                    level="error" if line in hard else "warning") for line in every]


def parallel_problems(config: dict, world_size: int | None) -> list[Problem]:
    """Tensor parallelism splits the ranks: autotp_size must divide the world (one rank without --world-size)."""
    section = config.get("tensor_parallel")
    size = section.get("autotp_size", 1) if isinstance(section, dict) else 1
    world = world_size or 1
    if not _int(size) or size <= 1 or world % size == 0:
        return []
    said = f"{world} rank(s)" + ("" if world_size else " (no world size given; pass --world-size)")
    return [Problem("tensor_parallel.autotp_size", f"={size} needs a multiple of {size} ranks; checked for {said}")]


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
    zero = _zero(config)
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key)
        if not isinstance(section, dict) or section.get("device") != "nvme":
            continue
        if device.name == "cpu":
            problems.append(Problem(f"zero_optimization.{key}.device", "=\"nvme\": NVMe offload (async I/O) is a GPU-host "
                                                                      "feature; offload to cpu here, or lint with --device cuda"))
        path = section.get("nvme_path")
        if device.local and (not isinstance(path, str) or not os.path.isdir(path)):
            problems.append(Problem(f"zero_optimization.{key}.nvme_path", f"={_show(path)} does not exist on this "
                                                                         "host: point it at a directory on an NVMe drive"))
    return problems


# --- optimizer -----------------------------------------------------------------------------------------

def optimizer_problems(config: dict, device: DeviceCaps) -> list[Problem]:
    """The optimizer DeepSpeedEngine would build from `optimizer`, checked without building its kernel."""
    section = config.get("optimizer")
    if not isinstance(section, dict):  # none: bigtrain fills one; HF/accelerate pass a client optimizer
        return []
    name, params = section.get("type"), section.get("params", {})
    if name is None:
        return []
    if not isinstance(name, str):
        return [Problem("optimizer.type", f"={_show(name)}: must be a name such as \"AdamW\"")]
    if not isinstance(params, dict):
        return [Problem("optimizer.params", f"={_show(params)}: must be an object like {{\"lr\": 0.001}}")]
    offload = _device_of(_zero(config), "offload_optimizer") != "none"
    cls = schema.optimizer_class(name, params, offload)
    if cls is None:
        return [Problem("optimizer.type", f"={_show(name)}: {_unknown_optimizer(name)}")]
    problems = []
    if "max_grad_norm" in params:
        problems.append(Problem("optimizer.params.max_grad_norm", "DeepSpeed refuses it as an optimizer parameter: "
                                                                  "use the top-level \"gradient_clipping\" instead"))
    lowered = name.lower()
    if device.name == "cpu" and lowered in GPU_ONLY_OPTIMIZERS:
        problems.append(Problem("optimizer.type", f"={_show(name)} has no CPU kernel (GPU only): use AdamW on this "
                                                  "machine, or lint with --device cuda for a GPU host"))
    if lowered == "lamb" and isinstance(config.get("fp16"), dict) and config["fp16"].get("loss_scale", 0) != 0:
        problems.append(Problem("fp16.loss_scale", f"={_show(config['fp16']['loss_scale'])}: DeepSpeed's Lamb needs "
                                                   "dynamic loss scaling; set fp16.loss_scale to 0"))
    if not isinstance(cls, str):
        problems += _params_problems(cls, lowered, params)
        problems += _untested_with_zero(config, cls, name)
    return problems


def _untested_with_zero(config: dict, cls: Any, name: str) -> list[Problem]:
    """DeepSpeed runs ZeRO only with optimizers it lists, unless zero_allow_untested_optimizer is set."""
    from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS
    stage = _zero(config).get("stage", 0)
    if not _int(stage) or stage < 1 or cls in ZERO_SUPPORTED_OPTIMIZERS or config.get("zero_allow_untested_optimizer"):
        return []
    return [Problem("optimizer.type", f"={_show(name)} with zero_optimization.stage={stage}: DeepSpeed refuses an "
                                      "optimizer it has not tested with ZeRO; set \"zero_allow_untested_optimizer\": "
                                      "true, or use Adam/AdamW")]


def _unknown_optimizer(name: str) -> str:
    lowered = name.lower()
    if lowered.startswith(("onebit", "zeroone")):  # OneBitAdam, ZeroOneAdam, OneBitLamb
        return ("the 1-bit optimizers are not in DeepSpeed 0.19 (removed); use \"Adam\" or \"AdamW\" "
                "(with ZeRO, or \"communication_data_type\" for smaller all-reduces)")
    torch_names = schema.torch_optimizers()
    same = [t for t in torch_names if t.lower() == lowered]
    if same:
        return f"DeepSpeed matches torch.optim names exactly: use {same[0]!r}"
    ours = [n.capitalize() if n not in ("adamw",) else "AdamW" for n in schema.deepspeed_optimizers()]
    close = difflib.get_close_matches(name, ours + torch_names, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return (f"DeepSpeed has no optimizer of that name; {hint}use one of {', '.join(ours)} (any case) or a "
            f"torch.optim class by its exact name ({', '.join(torch_names)})")


def _params_problems(cls: Any, lowered: str, params: dict) -> list[Problem]:
    """Build a torch optimizer as DeepSpeed would; bind a DeepSpeed op's signature (its kernel may need a GPU)."""
    import torch
    given = {k: HF_STANDINS.get(k, v) if v == "auto" else v for k, v in params.items() if k != "max_grad_norm"}
    given = {k: v for k, v in given.items() if v != "auto"}
    if lowered in ("adam", "adamw", "muon"):
        given = {k: v for k, v in given.items() if k not in schema.ADAM_POPPED}
        if cls in (torch.optim.Adam, torch.optim.AdamW):
            given.pop("foreach", None)
    dummy = [torch.nn.Parameter(torch.zeros(1))]
    try:
        if inspect.isclass(cls) and cls.__module__.startswith("torch."):
            with _light_optimizer_base():
                cls(dummy, **given)
        else:
            inspect.signature(cls.__init__).bind(None, dummy, **given)
    except TypeError as err:
        accepted = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "params")]
        bad = [k for k in given if k not in accepted]
        if bad:
            return [_param_line("optimizer.params", k, accepted, cls.__name__) for k in bad]
        return [Problem("optimizer.params", f"{cls.__name__} refuses {given}: {err}")]
    except (ValueError, RuntimeError) as err:
        return [Problem("optimizer.params", f"={_show(given)}: {cls.__name__} refuses it: {err}")]
    return []


@contextlib.contextmanager
def _light_optimizer_base():
    """`torch.optim.Optimizer.__init__` without its first-call import of torch._dynamo (seconds).

    A torch optimizer checks its arguments in its own `__init__` before calling the base class,
    and DeepSpeed's schedulers need only `param_groups`; lint builds both just for those checks.
    """
    import torch
    original = torch.optim.Optimizer.__init__

    def light(self, params, defaults):
        self.defaults, self.state = defaults, {}
        self.param_groups = [dict(defaults, params=list(params))]

    torch.optim.Optimizer.__init__ = light
    try:
        yield
    finally:
        torch.optim.Optimizer.__init__ = original


# Parameter names other tools use for an optimizer/scheduler argument -> DeepSpeed's name.
FOREIGN_PARAMS = {"learning_rate": "lr", "epsilon": "eps", "beta1": "betas", "beta2": "betas",
                  "max_grad_norm": "the top-level gradient_clipping", "warmup_steps": "warmup_num_steps",
                  "num_warmup_steps": "warmup_num_steps", "max_steps": "total_num_steps"}


def _param_line(section: str, key: str, accepted: list[str], owner: str) -> Problem:
    close = [FOREIGN_PARAMS[key]] if key in FOREIGN_PARAMS else \
        difflib.get_close_matches(key, accepted, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return Problem(f"{section}.{key}", f"unknown key '{section}.{key}': {owner} takes no {key!r}; {hint}"
                                       f"allowed: {', '.join(accepted)}")


# --- scheduler ---------------------------------------------------------------------------------------

def scheduler_problems(config: dict) -> list[Problem]:
    """Build DeepSpeed's scheduler on a dummy optimizer with the config's params, as the engine does."""
    import torch
    section = config.get("scheduler")
    if not isinstance(section, dict) or section.get("type") is None:
        return []
    name, params = section["type"], section.get("params", {})
    cls = schema.scheduler_class(name) if isinstance(name, str) else None
    if cls is None:
        close = difflib.get_close_matches(str(name), schema.scheduler_names(), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return [Problem("scheduler.type", f"={_show(name)}: DeepSpeed has no scheduler of that name; {hint}use one "
                                          f"of {', '.join(schema.scheduler_names())} or a torch.optim.lr_scheduler class")]
    if not isinstance(params, dict):
        return [Problem("scheduler.params", f"={_show(params)}: must be an object")]
    given = {k: HF_STANDINS.get(k, v) if v == "auto" else v for k, v in params.items()}
    if given.get("total_num_steps") == "auto":  # HF: the run's step count, at least the warmup
        warmup = given.get("warmup_num_steps")
        given["total_num_steps"] = max(warmup, 1000) if _int(warmup) else 1000
    given = {k: v for k, v in given.items() if v != "auto"}
    try:
        with _light_optimizer_base():
            optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
            cls(optimizer, **copy.deepcopy(given))
    except TypeError as err:
        accepted = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "optimizer")]
        bad = [k for k in given if k not in accepted]
        if bad:
            return [_param_line("scheduler.params", k, accepted, name) for k in bad]
        return [Problem("scheduler.params", f"{name} refuses {given}: {err}")]
    except (ValueError, AssertionError, RuntimeError, ZeroDivisionError) as err:
        return [Problem("scheduler.params", f"{name} refuses {_show(given)}: {_first_line(err)}")]
    return []


# --- DeepSpeed's own parser, the last gate ------------------------------------------------------------

class _FixedWorld:
    """An mpu stand-in: DeepSpeedConfig checks the batch triple at this data-parallel size."""

    def __init__(self, dp: int):
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1


def parser_problems(config: dict, world_size: int | None, pipeline_stages: int | None) -> list[Problem]:
    """Run `deepspeed.runtime.config.DeepSpeedConfig` on the config (HF "auto" stand-ins in place)."""
    from unittest import mock

    from deepspeed.runtime import config as ds_config
    body = _without_hf_auto(config)
    if world_size is not None:
        dp = max(1, world_size // pipeline_stages_of(config, pipeline_stages))
    else:
        total, micro, accum = (body.get(k) for k in BATCH_KEYS)
        dp = total // (micro * accum) if all(_int(v) and v > 0 for v in (total, micro, accum)) \
            and total % (micro * accum) == 0 else 1
    try:
        # With no process group DeepSpeedConfig falls back to world size 1 before it asks the mpu;
        # answering rank 0 makes it take the data-parallel size from the stand-in.
        with mock.patch.object(ds_config.dist, "get_rank", return_value=0):
            ds_config.DeepSpeedConfig(body, mpu=_FixedWorld(dp))
    except BaseException as err:  # noqa: BLE001 - DeepSpeed asserts, raises ValueError/ValidationError
        return [Problem("", f"DeepSpeed's config parser refuses it: {_first_line(err)}")]
    return []


def _without_hf_auto(config: dict) -> dict:
    """A copy with "auto" where the HF integration fills it replaced, so the parser sees a number."""
    body = copy.deepcopy(config)
    if any(body.get(k) == "auto" for k in BATCH_KEYS):
        for key in BATCH_KEYS:
            if body.get(key) == "auto":
                del body[key]
        if not any(_int(body.get(k)) for k in BATCH_KEYS[:2]):
            body["train_micro_batch_size_per_gpu"] = 1
            body.pop("train_batch_size", None)
    if body.get("gradient_clipping") == "auto":
        body["gradient_clipping"] = 1.0
    return body


def _show(value: Any) -> str:
    import json
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _first_line(err: BaseException) -> str:
    return next((ln.strip() for ln in str(err).splitlines() if ln.strip()), type(err).__name__)
