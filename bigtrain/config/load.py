"""Load a RunConfig from YAML/JSON and dotted `--set key=value` overrides, with typed errors."""
from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from bigtrain.config.run_config import RunConfig
from bigtrain.fields import field_doc


def load_run_config(path: str | Path | None = None, overrides: list[str] | None = None,
                    base: dict | None = None) -> RunConfig:
    """File (YAML or JSON) -> dict, then `overrides` like ["zero.stage=3"], then typed RunConfig."""
    data: dict = dict(base or {})
    if path is not None:
        data = deep_merge(data, read_mapping(path))
    for item in overrides or []:
        set_dotted(data, item)
    return from_dict(RunConfig, data)


def read_mapping(path: str | Path) -> dict:
    """A YAML or JSON file holding one mapping; errors name the file and the problem."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {path} does not exist")
    text = path.read_text()
    if not text.strip():
        raise ValueError(f"config file {path} is empty; give a YAML/JSON mapping such as 'zero: {{stage: 3}}'")
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise ValueError(f"config file {path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: "
                         f"{str(err).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of sections, got {type(data).__name__}")
    return data


def set_dotted(data: dict, item: str) -> None:
    """Apply one `a.b.c=value` override; the value is parsed as YAML (3, true, [0.9, 0.95], null)."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--set {item!r}: expected KEY=VALUE, e.g. --set zero.stage=3")
    try:
        set_dotted_value(data, key.strip(), yaml.safe_load(raw) if raw.strip() else None)
    except ValueError as err:
        raise ValueError(f"--set {item!r}: {err}") from None


def set_dotted_value(data: dict, key: str, value: Any) -> None:
    """`data[a][b][c] = value` for key "a.b.c", creating the sections on the way."""
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"{part} is a value, not a section")
    node[parts[-1]] = value


def field_sources(path: str | Path | None = None, overrides: list[str] | None = None) -> dict[str, str]:
    """Run-config field (dotted, e.g. "zero.stage") -> "--set" or "--config": the fields a user gave.

    The DeepSpeed JSON's precedence depends on it (bigtrain.ds.resolve): an explicit --set wins
    over the JSON, the JSON over the --config file and over the defaults."""
    sources: dict[str, str] = {}
    if path is not None:
        for key in _leaf_keys(read_mapping(path)):
            sources[_field_of(key)] = "--config"
    for item in overrides or []:
        key = item.partition("=")[0].strip()
        if key:
            sources[_field_of(key)] = "--set"
    return sources


def _leaf_keys(data: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        keys += _leaf_keys(value, dotted + ".") if isinstance(value, dict) and value else [dotted]
    return keys


def _field_of(key: str) -> str:
    """The run-config field a dotted key sets: "model.overrides.n_layer" -> "model.overrides"."""
    parts, cls, out = key.split("."), RunConfig, []
    for part in parts:
        known = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
        if part not in known:
            break
        out.append(part)
        cls = typing.get_type_hints(cls)[part]
    return ".".join(out) or key


def from_dict(cls: type, data: dict, prefix: str = "") -> Any:
    """Build dataclass `cls` from `data`, checking every key and value; errors name the dotted field."""
    if not isinstance(data, dict):
        raise ValueError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in known:
            message = unknown_key_message(prefix + str(key), str(key), list(known))
            if cls is RunConfig and not difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.6):
                message += f"; a model's shape is set as model.overrides.{key} (--set model.overrides.{key}=VALUE)"
            raise ValueError(message)
        kwargs[key] = _coerce(hints[key], value, prefix + key, known[key])
    try:
        return cls(**kwargs)
    except ValueError as err:
        if prefix and not str(err).startswith(prefix.rstrip(".")):
            raise ValueError(f"{prefix.rstrip('.')}: {err}") from None
        raise


def unknown_key_message(path: str, key: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown key {path!r}: {hint}allowed: {', '.join(sorted(allowed))}"


def _coerce(hint: Any, value: Any, path: str, f: dataclasses.Field | None = None) -> Any:
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value if value is not None else {}, path + ".")
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for option in inner[:-1]:  # e.g. `bool | Literal["auto"]`: the first type that takes the value
            try:
                return _coerce(option, value, path, f)
            except ValueError:
                pass
        return _coerce(inner[-1], value, path, f)
    if origin is Literal:
        if value not in args:
            raise ValueError(f"{path}={value!r}: allowed values are {', '.join(map(str, args))}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ValueError(f"{path}={value!r}: expected a list of {len(args)} values")
        return tuple(_coerce(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{path}={value!r}: expected a list, e.g. [a, b]")
        return [_coerce(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{path}={value!r}: expected a mapping, e.g. {{key: value}}")
        return value
    return _coerce_scalar(hint, value, path, f)


def _coerce_scalar(hint: type, value: Any, path: str, f: dataclasses.Field | None) -> Any:
    about = f" ({field_doc(f)})" if f is not None and field_doc(f) else ""
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{path}={value!r}: expected true or false{about}")
    if hint in (int, float):
        number = _number(value)
        if number is None or (hint is int and number != int(number)):
            raise ValueError(f"{path}={value!r}: expected {'an integer' if hint is int else 'a number'}{about}")
        return int(number) if hint is int else float(number)
    if hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):  # YAML reads `size: 50` as a number
            return str(value)
        raise ValueError(f"{path}={value!r}: expected a string{about}")
    raise AssertionError(f"unsupported config type {hint} at {path}")


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        try:
            return float(value)  # YAML reads 5e7 as a string
        except ValueError:
            return None
    return None


def deep_merge(base: dict, top: dict) -> dict:
    """`top` over `base`, recursively for nested mappings; neither input is modified."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def to_dict(run: RunConfig) -> dict:
    """Plain JSON/YAML-ready dict (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(run)))
