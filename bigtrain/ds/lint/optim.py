"""The optimizer and scheduler `deepspeed.initialize` would build from a config, checked without training.

They are looked up the way DeepSpeedEngine does, then checked by constructing them (torch classes;
DeepSpeed's schedulers on a dummy optimizer) or by binding the signature of DeepSpeed's op classes,
whose kernels may need a GPU to load. Each check returns `Problem`s, one line each.
"""
from __future__ import annotations

import collections
import copy
import difflib
import functools
import inspect
from typing import Any

from bigtrain.ds.lint import schema
from bigtrain.ds.lint.checks import DeviceCaps, Problem, first_line, is_int, offload_device, show, zero_section

GPU_ONLY_OPTIMIZERS = ("lamb",)  # FusedLamb: a CUDA kernel only
# What the HF integration puts where a file says "auto" (TrainingArguments defaults), for the
# constructor checks below; bigtrain's own fill comes from the run config before lint runs.
HF_STANDINS = {"lr": 5e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "warmup_min_lr": 0,
               "warmup_max_lr": 5e-5, "warmup_num_steps": 1}


# --- optimizer -----------------------------------------------------------------------------------------

def optimizer_problems(config: dict, device: DeviceCaps) -> list[Problem]:
    """The optimizer DeepSpeedEngine would build from `optimizer`, checked without building its kernel."""
    section = config.get("optimizer")
    if not isinstance(section, dict):  # none: bigtrain fills one; HF/accelerate pass a client optimizer
        return _client_optimizer_problems(config) if section is None else []
    name, params = section.get("type"), section.get("params", {})
    if name is None:
        return []
    if not isinstance(name, str):
        return [Problem("optimizer.type", f"={show(name)}: must be a name such as \"AdamW\"")]
    if not isinstance(params, dict):
        return [Problem("optimizer.params", f"={show(params)}: must be an object like {{\"lr\": 0.001}}")]
    offload = offload_device(zero_section(config), "offload_optimizer") != "none"
    cls = schema.optimizer_class(name, params, offload)
    if cls is None:
        return [Problem("optimizer.type", f"={show(name)}: {_unknown_optimizer(name)}")]
    problems = []
    if "max_grad_norm" in params:
        problems.append(Problem("optimizer.params.max_grad_norm", "DeepSpeed refuses it as an optimizer parameter: "
                                                                  "use the top-level \"gradient_clipping\" instead"))
    lowered = name.lower()
    if device.name == "cpu" and lowered in GPU_ONLY_OPTIMIZERS:
        problems.append(Problem("optimizer.type", f"={show(name)} has no CPU kernel (GPU only): use AdamW on this "
                                                  "machine, or lint with --device cuda for a GPU host"))
    offloaded = offload_device(zero_section(config), "offload_optimizer") != "none"
    if device.name == "cpu" and lowered == "lion" and not offloaded:
        # DeepSpeed builds FusedLion (a GPU kernel) unless the optimizer is offloaded (then DeepSpeedCPULion)
        problems.append(Problem("optimizer.type", f"={show(name)} without an offloaded optimizer is FusedLion, a GPU "
                                                  "kernel: set zero_optimization.offload_optimizer.device=cpu for "
                                                  "DeepSpeed's CPU Lion, use AdamW, or lint with --device cuda"))
    if lowered == "lamb" and isinstance(config.get("fp16"), dict) and config["fp16"].get("loss_scale", 0) != 0:
        problems.append(Problem("fp16.loss_scale", f"={show(config['fp16']['loss_scale'])}: DeepSpeed's Lamb needs "
                                                   "dynamic loss scaling; set fp16.loss_scale to 0"))
    if not isinstance(cls, str):
        problems += _params_problems(cls, lowered, params)
        problems += _untested_with_zero(config, cls, name)
    elif lowered == "muon":
        problems += muon_params_problems(params)
    return problems


def muon_params_problems(params: dict) -> list[Problem]:
    """DeepSpeed's Muon picks the keys each half takes (`DeepSpeedEngine._MUON_HALF_KEYS` / `_ADAM_HALF_KEYS`,
    `muon_lr` / `adam_lr`) and silently drops the rest, so a misspelt one would train at the defaults."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.muon.original_muon import NS_METHODS
    accepted = sorted({*DeepSpeedEngine._MUON_HALF_KEYS, *DeepSpeedEngine._ADAM_HALF_KEYS, "muon_lr", "adam_lr",
                       "per_head_muon", "foreach", *schema.ADAM_POPPED})
    problems = [_param_line("optimizer.params", key, accepted, "Muon") for key in params if key not in accepted]
    method = params.get("ns_method", "gram")
    if method not in NS_METHODS:
        problems.append(Problem("optimizer.params.ns_method", f"={show(method)}: DeepSpeed's Muon takes one of "
                                                              f"{', '.join(sorted(NS_METHODS))}"))
    return problems


def _untested_with_zero(config: dict, cls: Any, name: str) -> list[Problem]:
    """DeepSpeed runs ZeRO only with optimizers it lists, unless zero_allow_untested_optimizer is set."""
    from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS
    stage = zero_section(config).get("stage", 0)
    if not is_int(stage) or stage < 1 or cls in ZERO_SUPPORTED_OPTIMIZERS or config.get("zero_allow_untested_optimizer"):
        return []
    return [Problem("optimizer.type", f"={show(name)} with zero_optimization.stage={stage}: DeepSpeed refuses an "
                                      "optimizer it has not tested with ZeRO; set \"zero_allow_untested_optimizer\": "
                                      "true, or use Adam/AdamW")]


def _client_optimizer_problems(config: dict) -> list[Problem]:
    """No optimizer section: HF/accelerate pass a torch optimizer, swapped for DeepSpeedCPUAdam only when
    `zero_optimization.offload_optimizer.device` says so. Offload asked for another way (the deprecated
    `cpu_offload`) leaves the torch optimizer, which DeepSpeed refuses with ZeRO-Offload."""
    zero = zero_section(config)
    section = zero.get("offload_optimizer")
    stated = section.get("device", "none") if isinstance(section, dict) else "none"
    if stated != "none" or offload_device(zero, "offload_optimizer") == "none" or zero.get("stage", 0) not in (1, 2, 3) \
            or config.get("zero_force_ds_cpu_optimizer", True) is False:
        return []
    return [Problem("zero_optimization.cpu_offload", "=true (deprecated) with no optimizer section: a trainer's own "
                                                    "optimizer is not swapped for DeepSpeedCPUAdam and DeepSpeed refuses it "
                                                    "with ZeRO-Offload; write \"offload_optimizer\": {\"device\": \"cpu\"} "
                                                    "instead")]


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
            probe = light_probe(cls)
            probe(dummy, **given)
        else:
            inspect.signature(cls.__init__).bind(None, dummy, **given)
    except TypeError as err:
        accepted = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "params")]
        bad = [k for k in given if k not in accepted]
        if bad:
            return [_param_line("optimizer.params", k, accepted, cls.__name__) for k in bad]
        return [Problem("optimizer.params", f"{cls.__name__} refuses {given}: {err}")]
    except (ValueError, RuntimeError) as err:
        return [Problem("optimizer.params", f"={show(given)}: {cls.__name__} refuses it: {err}")]
    except Exception:  # noqa: BLE001 -- our light stand-in cannot build it; DeepSpeed's own check still runs at start
        return []
    return []


def light_probe(cls: type) -> type:
    """`cls` with `torch.optim.Optimizer.__init__` skipped (its first call imports torch._dynamo: seconds).

    A torch optimizer checks its arguments in its own `__init__` before calling the base class, and
    DeepSpeed's schedulers need only `param_groups`; lint builds both just for those checks. The light base
    sits between `cls` and `Optimizer` in the probe's MRO, so nothing shared is patched: lint may run in
    several threads at once (Tune's trials beside a Ray Train job) while other threads build real optimizers.
    """
    return _light_probe(cls, _light_base())


@functools.cache
def _light_base() -> type:
    import torch

    class LightOptimizerBase(torch.optim.Optimizer):
        def __init__(self, params, defaults):  # noqa: D107 -- what lint's checks read, nothing more
            self.defaults, self.state = defaults, collections.defaultdict(dict)
            self.param_groups = [dict(defaults, params=list(params))]

    return LightOptimizerBase


@functools.cache
def _light_probe(cls: type, base: type) -> type:
    return type(f"Lint{cls.__name__}", (cls, base), {"__module__": cls.__module__})


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
        return [Problem("scheduler.type", f"={show(name)}: DeepSpeed has no scheduler of that name; {hint}use one "
                                          f"of {', '.join(schema.scheduler_names())} or a torch.optim.lr_scheduler class")]
    if not isinstance(params, dict):
        return [Problem("scheduler.params", f"={show(params)}: must be an object")]
    given = {k: HF_STANDINS.get(k, v) if v == "auto" else v for k, v in params.items()}
    if given.get("total_num_steps") == "auto":  # HF: the run's step count, at least the warmup
        warmup = given.get("warmup_num_steps")
        given["total_num_steps"] = max(warmup, 1000) if is_int(warmup) else 1000
    given = {k: v for k, v in given.items() if v != "auto"}
    try:
        optimizer = light_probe(torch.optim.SGD)([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        cls(optimizer, **copy.deepcopy(given))
    except TypeError as err:
        accepted = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "optimizer")]
        bad = [k for k in given if k not in accepted]
        if bad:
            return [_param_line("scheduler.params", k, accepted, name) for k in bad]
        return [Problem("scheduler.params", f"{name} refuses {given}: {err}")]
    except (ValueError, AssertionError, RuntimeError, ZeroDivisionError) as err:
        return [Problem("scheduler.params", f"{name} refuses {show(given)}: {first_line(err)}")]
    return []
