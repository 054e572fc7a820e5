"""The one path from (run config, a user's DeepSpeed JSON or none, world size, device) to the
DeepSpeed dict the engine gets, and the run config that produced it.

`resolve` is used by the runner (`train/job.py`), `bigtrain lint`, `preflight`, `bench` and the
tests. Precedence, field by field:

- an explicit `--set` wins over the JSON; the JSON wins over the `--config` file and over
  bigtrain's defaults; where the two that meet disagree, one line names the field, both values
  and the winner;
- a section the JSON leaves out (zero_optimization, optimizer, scheduler, gradient_clipping,
  precision) comes from the run config, each named in one line; a key left out of a section the
  JSON has is DeepSpeed's to default, unless the user gave that field (`--config`/`--set`);
  missing optimizer parameters come from the run config;
- HF-style "auto" takes the run config's value, else DeepSpeed's default where DeepSpeed or the HF
  integration would leave it to that (`bigtrain.ds.auto`);
- a value the JSON gives is judged by DeepSpeed's rules (the lint), not the run config's: one the
  run config cannot hold (axolotl's `sub_group_size: 0`) runs as written, and one line says the
  recorded run config keeps its own value; a setting DeepSpeed ignores (`offload_param` below
  stage 3) is recorded as what runs;
- the batch triple is solved for the real data-parallel size: a triple written for another
  world size is fitted (global batch kept where possible), and on resume the checkpoint's
  global batch is kept unless `batch.global_batch` is given; one line says what changed. A batch
  that holds at no world size (`train_batch_size` not a multiple of micro x accum) is an error;
- `train.steps` decides the schedule length, whatever the file was written for.

The result is checked by the lint (`bigtrain.ds.lint`) before any rank trains.
"""
from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from bigtrain.config.run_config import RunConfig
from bigtrain.ds.auto import resolve_auto
from bigtrain.ds.batch import CONFIG, MEMBERS, SET, fit_batch, triple_world, user_batch, with_triple
from bigtrain.ds.generate import build_ds_config
from bigtrain.ds.lint import BATCH_KEYS, DeviceCaps, LintError, lint_problems, read_ds_json, \
    semantic_problems, unknown_keys, validate_with_deepspeed
from bigtrain.ds.lint import errors as lint_errors
from bigtrain.ds.lint import warnings as lint_warnings
from bigtrain.ds.mapping import (BATCH_FIELDS, LINKS, MISSING, absorb, field_value, get_path, json_key, set_path,
                                 stated, with_fields, with_json_fields)
from bigtrain.ds.runtime import fit_to_device
from bigtrain.config.topology import Topology

FILLED = ("zero_optimization", "optimizer", "scheduler", "gradient_clipping")


@dataclass
class Resolved:
    ds_config: dict  # exactly what deepspeed.initialize gets
    run: RunConfig  # the run config that dict trains with (every field it carries read back)
    notes: list[str]  # one line per decision: precedence, filled sections, batch fitting
    json_fields: frozenset[str] = frozenset()  # the run-config fields whose value the user's DeepSpeed JSON decided

    @property
    def recorded(self) -> dict:
        """The dict as checkpoints and the summary record it: what trains, without the one-time switch that
        loads this job's first checkpoint as a universal one (the next resume decides that afresh)."""
        if not (self.ds_config.get("checkpoint") or {}).get("load_universal"):
            return self.ds_config
        config = copy.deepcopy(self.ds_config)
        del config["checkpoint"]["load_universal"]
        if not config["checkpoint"]:
            del config["checkpoint"]
        return config


def resolve(run: RunConfig, user_json: dict | str | Path | None = None, world_size: int | None = None,
            device: DeviceCaps | None = None, *, sources: Mapping[str, str] | None = None,
            pipeline_stages: int | None = None, fit_world: bool = True, resume_batch: int | None = None,
            out_dir: str | None = None, batch: Mapping[str, int] | None = None,
            load_universal: bool = False) -> Resolved:
    """The DeepSpeed dict for this job, checked; raises LintError (a ValueError) naming every problem.
    It is the only producer of that dict: the engine gets exactly `ds_config`.

    `sources`: run-config field -> "--set" or "--config" (`config.load.field_sources`), what the
    user gave explicitly. `fit_world=False` (lint's strict mode) reports a complete triple written
    for another world size instead of fitting it. `resume_batch`: the global batch of the checkpoint
    this job resumes from, kept unless batch.global_batch is given. `out_dir`: where DeepSpeed's
    monitors write (None: no monitors, as lint shows it). `batch`: members the job itself fixes (the
    probed micro-batch with the global batch it keeps; a probe's one sample per rank), held like `--set`,
    the members left out derived. `load_universal`: this job loads its checkpoint as a universal one
    (`bigtrain.checkpoint.universal`); `Resolved.recorded` leaves that switch out.
    """
    device = device or DeviceCaps.detect()
    sources = dict(sources or {})
    notes: list[str] = []
    if batch:
        run, sources = _fixed_batch(run, batch, sources)
    if run.precision == "auto":
        run = with_fields(run, {"precision": _default_precision(device)})
    if pipeline_stages is not None:
        run = with_fields(run, {"pipeline.stages": pipeline_stages})
        sources["pipeline.stages"] = "--set"
    filled: list[str] = []  # sections bigtrain added to the user's JSON: an error in one must say so
    decided: frozenset[str] = frozenset()
    if user_json is None:
        config, run = _generated(run, world_size, sources, resume_batch, notes)
    else:
        user = copy.deepcopy(user_json) if isinstance(user_json, dict) else read_ds_json(user_json, notes)
        problems = unknown_keys(user)
        if problems:
            raise LintError(problems)
        try:
            config, run, decided = _from_user(user, run, world_size, sources, fit_world, resume_batch, notes)
        except LintError:
            raise
        except ValueError as err:
            raise LintError(_json_problems(user, world_size, device) or [f"DeepSpeed JSON: {err}"]) from None
        filled = [key for key in config if key not in user]
    try:
        config = fit_to_device(config, run, out_dir, device.name, notes)
    except (AttributeError, TypeError):  # a section of the wrong type ("zero_optimization": 2): the lint names it
        _check(config, world_size, device, notes, filled)
        raise
    if load_universal:
        config["checkpoint"] = {**config.get("checkpoint", {}), "load_universal": True}
    _check(config, world_size, device, notes, filled)
    notes += _all_warm_up(config)
    return Resolved(config, absorb(run, config), notes, decided)


def _all_warm_up(config: dict) -> list[str]:
    """A decaying schedule whose warm-up takes the whole run never decays: say so (a short test run, typically)."""
    params = (config.get("scheduler") or {}).get("params") or {}
    warmup, total = params.get("warmup_num_steps"), params.get("total_num_steps")
    if isinstance(warmup, int) and isinstance(total, int) and 0 < total <= warmup:
        return [f"warning: the schedule's warm-up ({warmup} steps) takes the whole run ({total} steps): the rate "
                "climbs to the peak and never decays; lower schedule.warmup_steps (or the JSON's warmup_num_steps)"]
    return []


def _fixed_batch(run: RunConfig, batch: Mapping[str, int], sources: dict) -> tuple[RunConfig, dict]:
    """`run` with the job's own batch members, held as `--set` holds them; the other members left to derive."""
    fields = {f"batch.{m}": batch.get(m) for m in MEMBERS}
    sources = {**{k: v for k, v in sources.items() if k not in fields},
               **{field: "--set" for field, value in fields.items() if value is not None}}
    return with_fields(run, fields), sources


def resolve_ds_file(path: str | Path, run: RunConfig, world_size: int | None, pipeline_stages: int | None = None,
                    device: DeviceCaps | None = None, fit_world: bool = False,
                    sources: Mapping[str, str] | None = None) -> Resolved:
    """`resolve` of a JSON file, in lint's strict mode by default (a triple for another world size is reported)."""
    return resolve(run, path, world_size, device, sources=sources, pipeline_stages=pipeline_stages,
                   fit_world=fit_world)


# --- the two inputs --------------------------------------------------------------------------------

def _generated(run: RunConfig, world_size: int | None, sources: dict, resume_batch: int | None,
               notes: list[str]) -> tuple[dict, RunConfig]:
    """No JSON: the run config decides everything."""
    if world_size is None:
        raise LintError(["a generated DeepSpeed config needs the world size; pass --world-size N"])
    dp = Topology.of_run(run.parallel, run.pipeline.stages, world_size).check().data
    # micro_batch=auto: the job probes it (train.autobatch); until then the triple derives one from the rest
    known = {m: (getattr(run.batch, m), SET if sources.get(f"batch.{m}") == "--set" else CONFIG)
             for m in MEMBERS if getattr(run.batch, m) not in (None, "auto")}
    triple = fit_batch(known, dp, resume_batch, sources, notes)
    run = with_triple(run, triple)
    return build_ds_config(run, world_size), run


def _from_user(user: dict, run: RunConfig, world_size: int | None, sources: dict, fit_world: bool,
               resume_batch: int | None, notes: list[str]) -> tuple[dict, RunConfig, frozenset[str]]:
    """The user's JSON completed from the run config, the run config it trains with, and the fields the JSON
    decided."""
    said = stated(user)
    mixed = _precedence(said, run, sources, notes)
    mixed_run, refused = with_json_fields(run, mixed)
    notes += [f"{json_key(field, user)}={_show(mixed[field])}: DeepSpeed takes it, but bigtrain's run config cannot "
              f"hold it ({why}); it runs as the JSON says, and the recorded run config keeps {field}="
              f"{_show(field_value(run, field))} (the recorded DeepSpeed dict is what ran)"
              for field, why in refused.items()]
    triple = user_batch(said, mixed_run, world_size, sources, fit_world, resume_batch, notes)
    if triple is not None:
        mixed_run = with_triple(mixed_run, triple)
    generated = build_ds_config(mixed_run, world_size or triple_world(user))
    config = copy.deepcopy(user)
    _fill_sections(config, generated, notes)
    for field, source in sources.items():
        decided_by_json = field in said and (source == "--config" or _same(said[field], field_value(run, field)))
        if field in LINKS and not decided_by_json:
            for path in LINKS[field]:
                set_path(config, path, get_path(generated, path))
                if path[-1].startswith("stage3_"):  # DeepSpeed also reads the name without the prefix
                    set_path(config, (*path[:-1], path[-1].removeprefix("stage3_")), MISSING)
    notes += _unrecorded(said, user)
    if "aio" in generated and "aio" not in config:
        config["aio"] = generated["aio"]
    _fill_optimizer_params(config, generated, notes)
    resolve_auto(config, generated, mixed_run, notes)
    if triple is not None:
        config.update(zip(BATCH_KEYS, (triple.global_batch, triple.micro_batch, triple.grad_accum)))
    return config, mixed_run, frozenset(mixed) - set(refused)


def _precedence(said: dict, run: RunConfig, sources: Mapping[str, str], notes: list[str]) -> dict[str, Any]:
    """The fields the JSON decides; one line per field where the JSON and --set/--config disagree."""
    mixed = {}
    for field, value in said.items():
        source = sources.get(field)
        current = field_value(run, field)
        if source is None:
            if field not in BATCH_FIELDS:
                mixed[field] = value
        elif not _same(value, current):
            if source == "--set":
                notes.append(f"precedence: {field}: --set gives {_show(current)}, the DeepSpeed JSON "
                             f"{_show(value)}; --set wins")
            else:
                notes.append(f"precedence: {field}: the DeepSpeed JSON gives {_show(value)}, --config "
                             f"{_show(current)}; the JSON wins")
                if field not in BATCH_FIELDS:
                    mixed[field] = value
    return mixed


def _unrecorded(said: dict, user: dict) -> list[str]:
    """An optimizer or scheduler the run config has no name for runs as the JSON says; the line says so."""
    lines = []
    optimizer, scheduler = user.get("optimizer"), user.get("scheduler")
    if isinstance(optimizer, dict) and "type" in optimizer and "optimizer.name" not in said:
        lines.append(f"optimizer.type={optimizer['type']!r} has no run-config name: it runs as the JSON says, and "
                     "the recorded run config's optimizer fields are not what ran (the recorded DeepSpeed dict is)")
    if isinstance(scheduler, dict) and "type" in scheduler and "schedule.kind" not in said:
        lines.append(f"scheduler.type={scheduler['type']!r} has no run-config name: it runs as the JSON says, and "
                     "the recorded run config's schedule fields are not what ran (the recorded DeepSpeed dict is)")
    return lines


def _fill_sections(config: dict, generated: dict, notes: list[str]) -> None:
    """Sections the JSON leaves out come from the run config, one line each."""
    for section in FILLED:
        if section not in config and section in generated:
            config[section] = copy.deepcopy(generated[section])
            notes.append(f"filled from the run config (the JSON has no {section}): "
                         f"{section} {json.dumps(generated[section])}")
    if not any(key in config for key in ("bf16", "bfloat16", "fp16")):
        config["bf16"], config["fp16"] = copy.deepcopy(generated["bf16"]), copy.deepcopy(generated["fp16"])
        precision = "bf16" if generated["bf16"]["enabled"] else "fp16" if generated["fp16"]["enabled"] else "fp32"
        notes.append(f"filled from the run config (the JSON sets no precision): {precision} "
                     f"(bf16.enabled={str(generated['bf16']['enabled']).lower()}, "
                     f"fp16.enabled={str(generated['fp16']['enabled']).lower()})")


def _fill_optimizer_params(config: dict, generated: dict, notes: list[str]) -> None:
    """A JSON optimizer of the type bigtrain generates gets the run config's values for the
    parameters it leaves out (DeepSpeed's defaults differ by the class it picks)."""
    mine, theirs = generated.get("optimizer") or {}, config.get("optimizer")
    if not isinstance(theirs, dict) or str(theirs.get("type", "")).lower() != str(mine.get("type", "")).lower():
        return
    params = theirs.setdefault("params", {})
    if not isinstance(params, dict):
        return
    added = [key for key in mine.get("params", {}) if key not in params and key != "torch_adam"]
    for key in added:
        params[key] = copy.deepcopy(mine["params"][key])
    if added:
        notes.append("filled from the run config (the JSON's optimizer leaves them out): "
                     + ", ".join(f"optimizer.params.{k}={_show(params[k])}" for k in added))


# --- checks ----------------------------------------------------------------------------------------

def _check(config: dict, world_size: int | None, device: DeviceCaps, notes: list[str], filled: list[str]) -> None:
    """The lint on the dict the engine will get: errors stop the job, warnings go to the notes. An error that
    names a section bigtrain filled in says so, since the user's JSON does not have that key."""
    problems = lint_problems(config, device, world_size)
    notes += [str(p) for p in lint_warnings(problems)]
    lines = []
    for problem in map(str, lint_errors(problems)):
        ours = [key for key in filled if re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", problem)]
        if ours:
            one = len(ours) == 1
            problem += (f" ({', '.join(ours)} {'is' if one else 'are'} not in the JSON: bigtrain filled "
                        f"{'it' if one else 'them'} from the run config; write {'it' if one else 'them'} in the JSON, "
                        "or change the run config's field)")
        lines.append(problem)
    if lines:
        raise LintError(lines)


def _json_problems(user: dict, world_size: int | None, device: DeviceCaps) -> list[str]:
    """What the lint says about a JSON whose values could not be read into a run config."""
    problems = semantic_problems(user, world_size, None, device)
    return problems or validate_with_deepspeed(user, triple_world(user))


def _default_precision(device: DeviceCaps) -> str:
    if device.name == "cpu":
        from bigtrain.distributed.device import default_precision
        return default_precision("cpu")
    return "bf16" if device.bf16 else "fp16"


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
            and not isinstance(b, bool):
        return abs(a - b) <= 1e-12 * max(abs(a), abs(b), 1.0)
    return a == b


def _show(value: Any) -> str:
    return json.dumps(list(value) if isinstance(value, tuple) else value)
