"""Reward functions users write, loaded by name and called as TRL's GRPOTrainer calls them.

objective.rewards lists one or more of

    path/to/file.py:function     a function in a Python file (relative to the working directory)
    package.module:function      a function in an importable module (the file's directory on PYTHONPATH)
    accuracy | format[=REGEX] | length[=MAX[,CACHE]]   the built-ins (bigtrain.rollout.builtin_rewards)
    path/to/reward_model_dir     a sequence classifier scored at its last token (bigtrain.rollout.reward_model;
                                 objective.kind=grpo / rloo take it as objective.reward_model instead, held
                                 frozen beside the policy and partitioned like it under ZeRO-3)

weighted by objective.reward_weights (1.0 each by default). A function is called once per batch of
completions as TRL calls it:

    f(prompts=[...], completions=[...], completion_ids=[[...], ...], trainer_state=..., <every other column of
      the records>=[...], log_metric=..., log_extra=...) -> list[float | None]

one value per completion (None: this function does not score it). A completion that every function scores None
is unscorable: left out of its group's statistics, advantage 0 (TRL's rule). `completions` are strings, or for
conversational prompts (message lists) a list of one assistant message each, as in TRL. As in TRL, a function may
call `log_metric(name, value)` (a number: the step's metric `name` is the mean of every value all ranks logged in
the round) and `log_extra(column, values)` (one value per completion it was given: a column of the sample table,
OUT/samples.jsonl). The `async def` functions run together, after the others, on one event loop of the process
that outlives the round (TRL's asyncio.gather on its loop's thread: bigtrain.rollout.event_loop).

A reward file that does not import, a name that is not there, a function that raises, returns the wrong count,
a NaN or something that is not a number: each is one ValueError line naming the function and the record.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import logging
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch

FLOAT32_MAX = float(torch.finfo(torch.float32).max)
log = logging.getLogger("bigtrain")

RewardFn = Callable[..., list]
RESERVED = ("prompt", "completion", "completion_ids")  # record columns TRL does not pass on


@dataclass
class RewardFunction:
    name: str  # its metric name: rewards/<name>/mean
    fn: RewardFn
    weight: float = 1.0
    spec: str = ""


@dataclass
class RewardScores:
    per_function: torch.Tensor  # [N, F] fp32, NaN where a function returned None
    metrics: dict[str, list[float]] = field(default_factory=dict)  # what the functions logged with log_metric
    extra: dict[str, list] = field(default_factory=dict)  # columns they added with log_extra, for the sample table


def load_rewards(specs: list[str], weights: list[float] | None = None, *, max_completion_length: int,
                 load_model: Callable[[Path], RewardFn] | None = None) -> list[RewardFunction]:
    """The reward functions objective.rewards names, in order, with their weights and unique metric names.
    `load_model` loads a reward-model directory (default: RewardModel.from_dir on this process's device)."""
    from bigtrain.rollout.builtin_rewards import builtin
    if not specs:
        raise ValueError("objective.rewards is empty: name at least one reward (a function file.py:name, "
                         "package.module:name, accuracy, format, length, or a reward model directory)")
    if weights is not None and len(weights) != len(specs):
        raise ValueError(f"objective.reward_weights has {len(weights)} weights for {len(specs)} rewards: give one "
                         "weight per reward")
    loaded, seen = [], {}
    for i, spec in enumerate(specs):
        fn = builtin(spec, max_completion_length)
        if fn is None and Path(spec).expanduser().is_dir():
            if load_model is None:
                from bigtrain.rollout.reward_model import RewardModel
                load_model = RewardModel.from_dir
            fn = load_model(Path(spec).expanduser())
        elif fn is None:
            fn = load_function(spec)
        name = getattr(fn, "__name__", None) or type(fn).__name__
        seen[name] = seen.get(name, 0) + 1
        name = name if seen[name] == 1 else f"{name}_{seen[name]}"
        loaded.append(RewardFunction(name, fn, 1.0 if weights is None else float(weights[i]), spec))
    return loaded


def load_function(spec: str, setting: str = "objective.rewards") -> RewardFn:
    """`path/to/file.py:function` or `package.module:function` -> the function (or class); one line naming
    `setting` when it cannot be had."""
    where, name = _split(spec, setting)
    module = _import_file(spec, Path(where).expanduser(), setting) if where.endswith(".py") else \
        _import_module(spec, where, setting)
    fn = getattr(module, name, None)
    if fn is None:
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise _no_such_name(spec, where, name, found, setting)
    if not callable(fn):
        raise ValueError(f"{setting} {spec!r}: {name!r} in {where} is {_a(type(fn).__name__)}, not a function")
    return fn


def check_function_file(spec: str) -> None:
    """Before any rank starts (bigtrain.train.precheck): a function spec's shape and, for a file, that it exists,
    parses and defines the name at its top level, read without importing it (a reward file may load a model when
    imported). The ranks' own lines. Left to the ranks: a module spec, a file that makes its names at run time (a
    star import, a module __getattr__, globals()), what importing it raises."""
    where, name = _split(spec)
    if not where.endswith(".py"):
        return
    path = Path(where).expanduser()
    _check_is_file(spec, path)
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError) as e:  # ValueError: null bytes
        raise ValueError(f"objective.rewards {spec!r}: {path} does not import: {_describe(e)}") from None
    names, functions = _top_level_names(tree.body)
    dynamic = any(isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names)
                  or isinstance(node, ast.Name) and node.id in ("globals", "exec", "setattr", "vars")
                  for node in ast.walk(tree)) or "__getattr__" in names
    if name not in names and not dynamic:
        raise _no_such_name(spec, where, name, sorted(f for f in functions if not f.startswith("_")))


def _top_level_names(body: list[ast.stmt]) -> tuple[set[str], set[str]]:
    """The names a module's statements bind (into if / try / with / for blocks, not into functions or classes),
    and which of them are functions."""
    names, functions = set(), set()
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
            if not isinstance(stmt, ast.ClassDef):
                functions.add(stmt.name)
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in stmt.names)
        elif isinstance(stmt, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            blocks = [getattr(stmt, b, []) for b in ("body", "orelse", "finalbody")]
            blocks += [h.body for h in getattr(stmt, "handlers", [])]
            heads = [stmt.target] if isinstance(stmt, ast.For) else \
                [i.optional_vars for i in stmt.items if i.optional_vars] if isinstance(stmt, ast.With) else []
            names.update(n.id for head in heads for n in ast.walk(head) if isinstance(n, ast.Name))
            for block in blocks:
                inner, inner_functions = _top_level_names(block)
                names |= inner
                functions |= inner_functions
        else:
            names.update(n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store))
    return names, functions


def _split(spec: str, setting: str = "objective.rewards") -> tuple[str, str]:
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        if setting != "objective.rewards":
            raise ValueError(f"{setting} {spec!r}: give path/to/file.py:NAME or package.module:NAME")
        cut = (" (a list's commas split length=MAX,CACHE: quote it, ['length=MAX,CACHE'])"
               if spec.strip().isdigit() else "")
        raise ValueError(f"objective.rewards {spec!r}: give path/to/file.py:function, package.module:function, a "
                         f"reward model directory, or a built-in (accuracy, format, length){cut}")
    return where, name


def _no_such_name(spec: str, where: str, name: str, found: list[str],
                  setting: str = "objective.rewards") -> ValueError:
    return ValueError(f"{setting} {spec!r}: {where} has no {name!r} (its functions: {', '.join(found) or 'none'})")


def _check_is_file(spec: str, path: Path, setting: str = "objective.rewards") -> None:
    if not path.is_file():
        raise ValueError(f"{setting} {spec!r}: no such file {path} (a path is relative to the directory the job "
                         "starts in)")


def _import_file(spec: str, path: Path, setting: str = "objective.rewards") -> Any:
    _check_is_file(spec, path, setting)
    folder = str(path.resolve().parent)
    if folder not in sys.path:  # its helpers beside it import, as they do when the file runs as a script
        sys.path.append(folder)
    module_name = f"bigtrain_reward_{abs(hash(str(path.resolve())))}"
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look a module up by name
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 -- anything the user's file raises: one line naming it
        sys.modules.pop(module_name, None)
        raise ValueError(f"{setting} {spec!r}: {path} does not import: {_describe(e)}") from None
    return module


def _import_module(spec: str, name: str, setting: str = "objective.rewards") -> Any:
    try:
        return importlib.import_module(name)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"{setting} {spec!r}: module {name!r} does not import: {_describe(e)} (a module "
                         "is found on PYTHONPATH; a file is given as path/to/file.py:function)") from None


def _a(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _describe(e: BaseException) -> str:
    if isinstance(e, SyntaxError):
        return f"SyntaxError: {e.msg} (line {e.lineno})"
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")


def score(functions: list[RewardFunction], prompts: list, completions: list, completion_ids: list[list[int]],
          records: list[dict], step: int = 0, extra: dict | None = None) -> RewardScores:
    """Every function on this rank's completions: [N, F] scores (NaN: None), what they logged. `records[i]` is
    completion i's record (its columns; repeated for the completions of one prompt); `extra`: more keywords
    (`environments`). The synchronous functions run in order, then the async ones together (TRL's asyncio.gather)."""
    n = len(completions)
    assert len(prompts) == n == len(completion_ids) == len(records), (len(prompts), n, len(records))
    keys = sorted({k for r in records for k in r if k not in RESERVED})
    columns = {k: [r.get(k) for r in records] for k in keys}
    out = RewardScores(torch.full((n, len(functions)), float("nan"), dtype=torch.float32))
    shared = {**columns, **(extra or {}), "trainer_state": SimpleNamespace(global_step=step),
              "log_metric": lambda name, value: out.metrics.setdefault(name, []).append(float(value)),
              "log_extra": lambda column, values: out.extra.setdefault(column, []).extend(values)}
    where = (records, prompts, completions)
    pending: list[tuple[int, RewardFunction, dict, Any]] = []
    try:
        for j, f in enumerate(functions):
            kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **shared)
            started = _start(f, kwargs, *where)
            if inspect.isawaitable(started):
                pending.append((j, f, kwargs, started))
            else:
                out.per_function[:, j] = _tensor(_checked(f, started, *where))
    except ValueError:
        for *_, awaitable in pending:  # never awaited now: closed, not left to warn
            getattr(awaitable, "close", lambda: None)()
        raise
    from bigtrain.rollout.event_loop import settle_all
    for (j, f, kwargs, _), values in zip(pending, settle_all([p[-1] for p in pending])):
        if isinstance(values, BaseException):
            raise _raised(f, values, kwargs, *where)
        out.per_function[:, j] = _tensor(_checked(f, values, *where))
    for column, values in out.extra.items():
        if len(values) != n:
            raise ValueError(f"log_extra({column!r}, ...) got {len(values)} values for {n} completions in all: a "
                             "reward function logs one value per completion of the batch it was given, once")
    _say_unscored(out.per_function, step, *where)
    return out


def _say_unscored(per_function: torch.Tensor, step: int, records: list[dict], prompts: list,
                  completions: list) -> None:
    unscored = torch.isnan(per_function).all(dim=1)
    if per_function.shape[1] and unscored.any() and not _said_unscored:
        _said_unscored.append(True)  # once a process: TRL warns each time, which floods a long run
        i = int(unscored.nonzero()[0])
        log.warning("every reward function returned None for %d of %d completions at step %d (first: %s): they get "
                    "no reward and teach nothing; have at least one function score every completion",
                    int(unscored.sum()), len(completions), step, _record_line(i, records, prompts, completions))


_said_unscored: list[bool] = []


def _tensor(values: list) -> torch.Tensor:
    return torch.tensor([float("nan") if v is None else v for v in values])


def _start(f: RewardFunction, kwargs: dict, records: list[dict], prompts: list, completions: list) -> Any:
    """f called on the batch: its values, or the awaitable an async function gives."""
    if missing := _missing_columns(f.fn, kwargs):
        raise ValueError(f"reward function {f.name!r} ({f.spec}) asks for {', '.join(map(repr, missing))}, which "
                         f"neither the records nor bigtrain give: it gets {', '.join(sorted(kwargs))}; rename the "
                         "parameter, give it a default, or add the column to the data")
    try:
        return f.fn(**_accepted(f.fn, kwargs))
    except (Exception, SystemExit) as e:  # noqa: BLE001 -- the user's code: name the function and where it fails
        raise _raised(f, e, kwargs, records, prompts, completions) from None


def _raised(f: RewardFunction, e: BaseException, kwargs: dict, records: list[dict], prompts: list,
            completions: list) -> ValueError:
    return ValueError(f"reward function {f.name!r} ({f.spec}) raised {_describe(e)} on "
                      f"{_culprit(f, kwargs, len(completions), records, prompts, completions)}")


def _checked(f: RewardFunction, values: Any, records: list[dict], prompts: list, completions: list) -> list:
    """The values a function returned as floats (None kept), or one line saying what is wrong with them."""
    n = len(completions)
    try:
        if isinstance(values, (str, bytes, Mapping, set)):  # iterable, but not one value per completion in order
            raise TypeError  # (a dict would give its keys)
        values = list(values)
    except TypeError:
        raise ValueError(f"reward function {f.name!r} ({f.spec}) returned {type(values).__name__}: return a list "
                         f"of {n} floats (None to skip a completion)") from None
    if len(values) != n:
        raise ValueError(f"reward function {f.name!r} ({f.spec}) returned {len(values)} rewards for {n} "
                         "completions: return one per completion (None to skip one)")
    for i, v in enumerate(values):
        if v is None:
            continue
        if not (isinstance(v, (int, float)) or _is_scalar(v)):
            raise ValueError(f"reward function {f.name!r} ({f.spec}) returned {type(v).__name__} {v!r:.40} for "
                             f"{_record_line(i, records, prompts, completions)}: return a number, or None to skip "
                             "the completion")
        number = _as_float(v)
        if not math.isfinite(number) or abs(number) > FLOAT32_MAX:  # scores are float32: 1e39 would be inf there
            raise ValueError(f"reward function {f.name!r} ({f.spec}) returned {v!r:.40} for "
                             f"{_record_line(i, records, prompts, completions)}: return a finite number within "
                             "float32's range (|r| <= 3.4e38), or None to skip the completion")
        values[i] = number
    return values


def _as_float(v: Any) -> float:
    try:
        return float(v)
    except OverflowError:  # an int beyond any float
        return math.inf


def _invoke(fn: Callable, kwargs: dict) -> Any:
    """fn's result on the keywords it takes; an async def reward's awaited."""
    from bigtrain.rollout.event_loop import settle_all
    values = fn(**_accepted(fn, kwargs))
    if inspect.isawaitable(values):
        (values,) = settle_all([values])
        if isinstance(values, BaseException):
            raise values
    return values


def _missing_columns(fn: Callable, kwargs: dict) -> list[str]:
    """The parameters `fn` requires by name that no column or argument fills (a typo of a column: 'answers')."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is inspect.Parameter.empty and p.name not in kwargs
            and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]


def _is_scalar(v: Any) -> bool:
    """numpy / torch scalars count as numbers."""
    return hasattr(v, "item") and getattr(v, "ndim", 0) == 0 and isinstance(v.item(), (int, float))


def _accepted(fn: Callable, kwargs: dict) -> dict:
    """All keywords for a function taking **kwargs (TRL's convention), else the ones it names."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return kwargs
    names = {p.name for p in params}
    return {k: v for k, v in kwargs.items() if k in names}


def _culprit(f: RewardFunction, kwargs: dict, n: int, records: list[dict], prompts: list,
             completions: list) -> str:
    """The first completion the function raises on alone (re-run one at a time), or the batch."""
    for i in range(n):
        one = {k: (v[i:i + 1] if isinstance(v, list) and len(v) == n else v) for k, v in kwargs.items()}
        try:
            _invoke(f.fn, one)
        except (Exception, SystemExit):  # noqa: BLE001
            return _record_line(i, records, prompts, completions)
    return f"a batch of {n} completions (each alone scores): it fails on the batch as a whole"


def _record_line(i: int, records: list[dict], prompts: list, completions: list) -> str:
    shown = json.dumps({"prompt": prompts[i], **{k: v for k, v in records[i].items() if k not in RESERVED}},
                       ensure_ascii=False, default=str)
    completion = json.dumps(completions[i], ensure_ascii=False, default=str)
    return (f"completion {i} (record {shown[:120]}{'...' if len(shown) > 120 else ''}, completion "
            f"{completion[:60]}{'...' if len(completion) > 60 else ''})")
