"""Lint a DeepSpeed config the way DeepSpeed 0.19's parser and `deepspeed.initialize` judge it.

Every problem in one pass, one line each naming the key path, the value and the fix; never a
traceback. `lint_problems` is the entry point (`bigtrain.ds.resolve` calls it on the dict the
engine will get); it returns errors (DeepSpeed would refuse the config, or bigtrain would not run
it) and warnings (DeepSpeed would run it but ignore something). What DeepSpeed reads comes from
`schema` (beside this file), which asks the installed DeepSpeed, so an upgrade does not leave this stale.

Policy for keys DeepSpeed does not read: inside a section DeepSpeed validates with a pydantic
model it is an error (DeepSpeed refuses it); elsewhere DeepSpeed ignores it, so it is a warning
(`_comment`, a tool's own notes) unless it is a near miss of a key DeepSpeed reads
(`zero_optimisation`) or a name other tools use for a DeepSpeed setting (`max_grad_norm`): then it
is an error with the key meant, because the setting would be silently dropped.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bigtrain.ds.lint import schema
from bigtrain.ds.lint.checks import (BATCH_KEYS, DeviceCaps, Problem, batch_problems, device_problems, first_line,
                                     layout_lint, parser_problems)
from bigtrain.ds.lint.levers import muon_zero_problems, split_problems, zero_plus_plus_problems
from bigtrain.ds.lint.optim import FOREIGN_PARAMS, optimizer_problems, scheduler_problems

# Names other tools (HF TrainingArguments, Megatron, Lightning, Apex) use for a DeepSpeed setting.
FOREIGN = {
    "max_grad_norm": "gradient_clipping (a number, e.g. \"gradient_clipping\": 1.0)",
    "clip_grad": "gradient_clipping", "grad_clip": "gradient_clipping",
    "fp16_opt_level": "the fp16 or bf16 section ({\"bf16\": {\"enabled\": true}}); Apex opt levels are gone",
    "mixed_precision": "the fp16 or bf16 section ({\"bf16\": {\"enabled\": true}})",
    "amp_level": "the fp16 or bf16 section", "half_precision": "the fp16 or bf16 section",
    "learning_rate": "optimizer.params.lr", "lr": "optimizer.params.lr",
    "weight_decay": "optimizer.params.weight_decay", "adam_epsilon": "optimizer.params.eps",
    "adam_beta1": "optimizer.params.betas", "adam_beta2": "optimizer.params.betas",
    "warmup_steps": "scheduler.params.warmup_num_steps", "num_warmup_steps": "scheduler.params.warmup_num_steps",
    "max_steps": "scheduler.params.total_num_steps",
    "per_device_train_batch_size": "train_micro_batch_size_per_gpu", "micro_batch_size": "train_micro_batch_size_per_gpu",
    "batch_size": "train_micro_batch_size_per_gpu (per rank) or train_batch_size (global)",
    "global_batch_size": "train_batch_size",
    "gradient_accumulation": "gradient_accumulation_steps", "grad_accum": "gradient_accumulation_steps",
    "zero_stage": "zero_optimization.stage", "stage": "zero_optimization.stage", "zero": "zero_optimization",
    "offload_optimizer": "zero_optimization.offload_optimizer", "offload_param": "zero_optimization.offload_param",
    "gradient_checkpointing": "activation_checkpointing", "logging_steps": "steps_per_print",
    "torch_compile": "compile",
}


class LintError(ValueError):
    """One or more problems in a DeepSpeed config; `problems` holds one line each."""

    def __init__(self, problems: list):
        lines = [str(p) for p in problems]
        super().__init__("\n".join(lines))
        self.problems = lines


def errors(problems: list[Problem]) -> list[Problem]:
    return [p for p in problems if p.level == "error"]


def warnings(problems: list[Problem]) -> list[Problem]:
    return [p for p in problems if p.level == "warning"]


def lint_problems(config: Any, device: DeviceCaps, world_size: int | None = None,
                  pipeline_stages: int | None = None) -> list[Problem]:
    """Everything wrong with `config` for `world_size` ranks on `device`, errors and warnings.

    HF-style "auto" is accepted where the Hugging Face integration or bigtrain fills it
    (`schema.hf_auto_keys`) and wherever DeepSpeed's pydantic models drop it. Without a world size
    a complete batch triple is checked at the data-parallel size it was written for.
    """
    if not isinstance(config, dict):
        return [Problem("", f"the top level must be a JSON object, got {type(config).__name__}")]
    problems = key_problems(config)
    problems += batch_problems(config, world_size, pipeline_stages)
    problems += layout_lint(config, pipeline_stages) + split_problems(config, world_size)
    problems += device_problems(config, device) + zero_plus_plus_problems(config, world_size, device)
    problems += optimizer_problems(config, device) + muon_zero_problems(config)
    problems += scheduler_problems(config)
    if not errors(problems):
        problems += parser_problems(config, world_size, pipeline_stages)
    return problems


# --- keys and value types ----------------------------------------------------------------------

def key_problems(config: dict) -> list[Problem]:
    """Unknown, removed, near-miss and foreign keys at every level, and values of the wrong type."""
    known, removed = schema.top_level(), schema.removed_keys(())
    problems = []
    for key, value in config.items():
        if key in removed:
            problems.append(Problem(key, f"DeepSpeed refuses this key: {removed[key]}"))
        elif key not in known:
            problems.append(_unknown((), key, set(known), ignored=True, foreign=FOREIGN))
        else:
            problems += _value_problems((key,), value, known[key])
    return problems


def _value_problems(path: tuple[str, ...], value: Any, default: Any) -> list[Problem]:
    dotted = ".".join(path)
    if value == "auto":
        if dotted in schema.hf_auto_keys():
            return []
        return [Problem(dotted, f"={_show(value)}: DeepSpeed does not fill \"auto\" here and the HF integration "
                                "fills it only at its own keys; give a value")]
    if path in (("optimizer",), ("scheduler",)):
        return [] if isinstance(value, dict) else [Problem(dotted, f"={_show(value)}: must be an object like "
                                                                   "{\"type\": ..., \"params\": {...}}")]
    if path == ("zero_optimization",) and not isinstance(value, (dict, bool)):  # a bool: DeepSpeed's legacy form
        return [Problem(dotted, f"={_show(value)}: must be an object like {{\"stage\": 2}}")]
    if not isinstance(value, dict):
        if default in (None, schema.NO_DEFAULT) and path != ("zero_optimization",) and schema.probe(path).model:
            return [Problem(dotted, f"={_show(value)}: must be an object, e.g. {{\"enabled\": true}}")]
        return _type_problems(dotted, value, default)  # (a bool zero_optimization is DeepSpeed's legacy form)
    found = schema.probe(path)
    if found.model is not None:
        return _model_problems(path, value, found.model)
    if isinstance(default, (bool, int, float, str, list)) and default is not schema.NO_DEFAULT:
        return _type_problems(dotted, value, default)
    if found.iterated:  # DeepSpeed takes the dict whole; check only against the keys its readers name
        known = schema.open_section_known(path)
        return [_unknown(path, k, known, ignored=True) for k in value if k not in known] if known else []
    keys = schema.section_keys(path) or {}
    if not keys:
        return []  # DeepSpeed reads nothing here (a value it passes on whole, e.g. optimizer.params)
    problems = []
    for key, sub in value.items():
        if key not in keys:
            problems.append(_unknown(path, key, set(keys), ignored=True))
        else:
            problems += _value_problems(path + (key,), sub, keys[key])
    return problems


def _type_problems(dotted: str, value: Any, default: Any) -> list[Problem]:
    """A scalar against the type of the default DeepSpeed reads it with (none known: no check)."""
    if default is schema.NO_DEFAULT or default is None or dotted in BATCH_KEYS:
        return []
    want = {bool: "true or false (a JSON boolean)", int: "a number", float: "a number", str: "a string",
            list: "a list", dict: "an object"}.get(type(default))
    if want is None:
        return []
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, (int, float)):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, type(default))
    if ok:
        return []
    hint = " without quotes" if isinstance(value, str) else ""
    return [Problem(dotted, f"={_show(value)}: must be {want}{hint} (DeepSpeed's default is {_show(default)})")]


def _model_problems(path: tuple[str, ...], value: dict, model: Any) -> list[Problem]:
    """Validate a section with DeepSpeed's own pydantic model; one line per field error."""
    from pydantic import ValidationError
    removed = schema.removed_keys(path)
    problems = [Problem(".".join(path + (k,)), f"DeepSpeed refuses this key: {removed[k]}") for k in value
                if k in removed]
    body = {k: v for k, v in value.items() if k not in removed}
    try:
        built = model(**body)
    except ValidationError as err:
        problems += [_field_problem(path, model, e) for e in err.errors()]
    except Exception as err:  # noqa: BLE001 - DeepSpeed's validators assert and raise ValueError
        problems.append(Problem(".".join(path), f"DeepSpeed's {model.__name__} refuses it: {first_line(err)}"))
    else:
        problems += _deprecated(path, body, built)
    return problems


def _deprecated(path: tuple[str, ...], body: dict, built: Any) -> list[Problem]:
    """Fields DeepSpeed's model marks deprecated (it logs a warning and maps them to the new field)."""
    problems = []
    for name, info in type(built).model_fields.items():
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        if extra.get("deprecated") and (name in body or (info.alias and info.alias in body)):
            new = extra.get("new_param")
            problems.append(Problem(".".join(path + (name,)), f"is deprecated in DeepSpeed{f'; use {new}' if new else ''}",
                                    level="warning"))
    return problems


def _field_problem(path: tuple[str, ...], model: Any, error: dict) -> Problem:
    loc = tuple(str(p) for p in error.get("loc", ()))
    dotted = ".".join(path + loc)
    if error.get("type") == "extra_forbidden":
        owner = model
        for part in loc[:-1]:
            owner = schema.model_fields(owner).get(part) if owner is not None else None
        allowed = set(schema.model_fields(owner)) if owner is not None else set()
        return _unknown(path + loc[:-1], loc[-1], allowed, ignored=False, foreign=FOREIGN_PARAMS)
    value = error.get("input")
    message = error.get("msg", "invalid").rstrip(".")
    return Problem(dotted, f"={_show(value)}: {message} (DeepSpeed's {model.__name__})")


# --- unknown keys ------------------------------------------------------------------------------------

def _unknown(parent: tuple[str, ...], key: str, allowed: set[str], ignored: bool,
             foreign: dict[str, str] | None = None) -> Problem:
    """An unknown key: an error with the key meant, or (ignored by DeepSpeed, no near miss) a warning."""
    dotted = ".".join(parent + (key,))
    if foreign and key in foreign:
        return Problem(dotted, f"unknown key {dotted!r}: DeepSpeed does not read it; did you mean {foreign[key]}?")
    near = _near_miss(key, allowed)
    if near:
        return Problem(dotted, f"unknown key {dotted!r}: did you mean {near!r}?")
    if ignored:
        return Problem(dotted, f"key {dotted!r} is not read by DeepSpeed and will be ignored (fine for a comment "
                               "or a tool's own setting)", level="warning")
    import difflib
    close = difflib.get_close_matches(key, sorted(allowed), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return Problem(dotted, f"unknown key {dotted!r}: {hint}allowed: {', '.join(sorted(allowed))}")


def _near_miss(key: str, allowed: set[str]) -> str | None:
    """A key DeepSpeed reads that `key` looks like a typo of (case, separators, 1-2 letters)."""
    def norm(s: str) -> str:
        return s.lower().replace("-", "_").replace(" ", "_")
    budget = max(1, len(key) // 8)
    best = None
    for name in sorted(allowed):
        if norm(name) == norm(key):
            return name
        distance = _edit_distance(norm(key), norm(name))
        if distance <= budget and (best is None or distance < best[0]):
            best = (distance, name)
    return best[1] if best else None


def _edit_distance(a: str, b: str) -> int:
    """Optimal string alignment distance (a swap of two letters counts once)."""
    rows = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            cost = a[i - 1] != b[j - 1]
            rows[i][j] = min(rows[i - 1][j] + 1, rows[i][j - 1] + 1, rows[i - 1][j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                rows[i][j] = min(rows[i][j], rows[i - 2][j - 2] + 1)
    return rows[-1][-1]


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (str, bool, int, float, type(None), list)) else repr(value)


# --- reading a file ----------------------------------------------------------------------------------

def read_ds_json(path: str | Path, notes: list[str] | None = None) -> dict:
    """The JSON object in `path`; LintError naming every duplicate key or the parse error.

    A file that is not strict JSON but that DeepSpeed's own reader (hjson) takes is read like
    DeepSpeed reads it, with a warning in `notes`.
    """
    path = Path(path)
    if not path.is_file():
        raise LintError([f"{path}: no such file; pass a DeepSpeed JSON such as ds_configs/zero2.json"])
    text = path.read_text()
    if not text.strip():
        raise LintError([f"{path}: the file is empty; a DeepSpeed config is a JSON object like {{\"train_batch_size\": 8}}"])
    duplicates: list[tuple[dict, str]] = []

    def pairs(items: list) -> dict:
        out: dict = {}
        for key, value in items:
            if key in out:
                duplicates.append((out, key))
            out[key] = value
        return out

    try:
        data = json.loads(text, object_pairs_hook=pairs)
    except json.JSONDecodeError as err:
        data = _read_hjson(text, pairs)
        if data is None:
            raise LintError([f"{path}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno})"]) from None
        if notes is not None:
            notes.append(f"warning: {path} is not strict JSON ({err.msg} at line {err.lineno} column {err.colno}); "
                         "DeepSpeed reads it as hjson, other tools may not")
    if not isinstance(data, dict):
        raise LintError([f"{path}: the top level must be a JSON object, got {type(data).__name__}"])
    if duplicates:
        raise LintError([f"{_path_of(data, parent) or '(top level)'}: key {key!r} appears more than once; DeepSpeed "
                         "refuses duplicate keys: keep one" for parent, key in duplicates])
    return data


def _read_hjson(text: str, pairs: Any) -> Any:
    try:
        import hjson
        return json.loads(json.dumps(hjson.loads(text, object_pairs_hook=pairs)), object_pairs_hook=pairs)
    except Exception:  # noqa: BLE001 - not readable by DeepSpeed either
        return None


def _path_of(node: Any, target: dict, prefix: str = "") -> str | None:
    if node is target:
        return prefix
    if isinstance(node, dict):
        for key, value in node.items():
            found = _path_of(value, target, f"{prefix}.{key}" if prefix else key)
            if found is not None:
                return found
    return None


# --- the entry points bigtrain.ds.resolve and the tests use -----------------------------------------

def unknown_keys(config: dict) -> list[str]:
    """Error lines about keys and value types, batch sizes included: what is wrong with a raw user JSON
    whatever fills it later ("auto" where HF fills it, and missing sections, are fine)."""
    mistyped = [p for p in batch_problems(config, None, None) if "must be a positive integer" in p.message]
    return [str(p) for p in errors(key_problems(config)) + mistyped]


def key_warnings(config: dict) -> list[str]:
    """Warning lines about keys DeepSpeed ignores."""
    return [str(p) for p in warnings(key_problems(config))]


def semantic_problems(config: dict, world_size: int | None, pipeline_stages: int | None,
                      device: DeviceCaps) -> list[str]:
    """Error lines about batch, layout, device, optimizer and scheduler."""
    problems = batch_problems(config, world_size, pipeline_stages) + layout_lint(config, pipeline_stages)
    problems += split_problems(config, world_size) + zero_plus_plus_problems(config, world_size, device)
    problems += device_problems(config, device) + optimizer_problems(config, device) + scheduler_problems(config)
    problems += muon_zero_problems(config)
    return [str(p) for p in errors(problems)]


def validate_with_deepspeed(config: dict, dp_size: int | None) -> list[str]:
    """Error lines from DeepSpeed's own config parser at data-parallel size `dp_size`."""
    return [str(p) for p in errors(parser_problems(config, dp_size, 1))]
