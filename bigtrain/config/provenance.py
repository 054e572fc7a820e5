"""Where a run's rate, weight decay, Adam's betas and schedule came from: a user's (--set, the config file, a DeepSpeed
JSON), the checkpoint a resume continues (`keep_recorded`), or the defaults chosen by what the run is
(`bigtrain.config.defaults`); `describe` says it in the job's start line and under `bigtrain estimate`'s command.
"""
from __future__ import annotations

import dataclasses
from dataclasses import replace
from typing import Any, Mapping

from bigtrain.config.defaults import CHOSEN, Chosen, choose
from bigtrain.config.run_config import RunConfig

# what a resume keeps from its checkpoint unless given again: the chosen fields and the schedule's shape
KEPT_ON_RESUME = (*CHOSEN, "schedule.kind", "schedule.min_lr_ratio")
# where a value came from (`provenance`) -> how the start line says it
SAID = {"--set": "your --set", "--config": "your config file", "json": "your DeepSpeed JSON",
        "resume": "kept from the run it resumes", "every run's": "bigtrain's default"}
DEFAULT, EVERY_RUNS = "default", "every run's"  # a default chosen by what the run is; one every run has


def chosen_for(run: RunConfig) -> Chosen:
    """The defaults `run` gets by what it is."""
    return choose(run.model.pretrained, run.objective.kind, run.lora.r > 0)


def keep_recorded(run: RunConfig, recorded: Mapping[str, Any], sources: Mapping[str, str] | None
                  ) -> tuple[RunConfig, tuple[str, ...]]:
    """`run` resuming a checkpoint whose run config is `recorded`: each field of `KEPT_ON_RESUME` the user does not
    give (`sources`; None when unknown: a value other than this run's default counts as given) takes the recorded
    value. Returns the run and the fields whose value that changed."""
    given = set(sources) if sources is not None else {f for f in KEPT_ON_RESUME if value(run, f) != default(run, f)}
    changed: dict[str, dict[str, Any]] = {}  # section -> {name: the recorded value}
    for field in KEPT_ON_RESUME:
        section, name = field.split(".")
        saved = (recorded.get(section) or {}).get(name)
        saved = tuple(saved) if isinstance(saved, list) else saved  # a recorded pair (the betas) reads back a list
        if field not in given and saved is not None and saved != value(run, field):
            changed.setdefault(section, {})[name] = saved
    if not changed:
        return run, ()
    kept = replace(run, **{section: replace(getattr(run, section), **names) for section, names in changed.items()})
    return kept, tuple(f"{section}.{name}" for section, names in changed.items() for name in names)


def provenance(sources: Mapping[str, str] | None, json_fields: frozenset[str] | set[str],
               kept: tuple[str, ...] = ()) -> dict[str, str]:
    """Field -> where its value came from ("--set", "json", "--config", "resume"; a default is left out), by the
    precedence `bigtrain.ds.resolve` applies: --set over the DeepSpeed JSON over the config file."""
    sources = sources or {}
    out = {}
    for field in KEPT_ON_RESUME:
        if sources.get(field) == "--set":
            out[field] = "--set"
        elif field in json_fields:
            out[field] = "json"
        elif field in sources:
            out[field] = sources[field]
        elif field in kept:
            out[field] = "resume"
    return out


def describe(run: RunConfig, given: Mapping[str, str], json_schedule: str | None = None) -> str:
    """The start line's account of the rate, weight decay, betas and schedule: each value and where it came from
    (`given`: `provenance`; a default says why it was chosen). `json_schedule`: the type of a DeepSpeed JSON scheduler the run
    config has no name for, which then decides the warm-up and decay."""
    opt, schedule = run.optimizer, run.schedule
    warmup = {0: "no warm-up", 1: "1 warm-up step"}.get(schedule.warmup_steps, f"{schedule.warmup_steps} warm-up steps")
    decay = ("then constant" if schedule.kind == "constant" else
             f"{schedule.kind} decay to {schedule.min_lr_ratio:.0%} of the peak by step {run.train.steps}")
    items = [(f"lr {opt.lr:.3g}", _source(given, "optimizer.lr"), ["optimizer.lr"]),
             (f"weight decay {opt.weight_decay:g}", _source(given, "optimizer.weight_decay"),
              ["optimizer.weight_decay"])]
    if opt.name != "sgd":  # Adam's (Muon's Adam half's); SGD has none
        items.append((f"betas ({opt.betas[0]:g}, {opt.betas[1]:g})", _source(given, "optimizer.betas"),
                      ["optimizer.betas"]))
    if json_schedule is None:
        items += [(warmup, _source(given, "schedule.warmup_steps"), ["schedule.warmup_steps"]),
                  (decay, _source(given, "schedule.kind", "schedule.min_lr_ratio", otherwise=EVERY_RUNS), [])]
    else:
        items.append((f"the {json_schedule} schedule", "json", []))
    groups: list[tuple[list[str], str, list[str]]] = []  # consecutive items of one source: (texts, source, fields)
    for text, source, fields in items:
        if groups and groups[-1][1] == source:
            groups[-1][0].append(text)
            groups[-1][2].extend(fields)
        else:
            groups.append(([text], source, list(fields)))
    why, said = chosen_for(run).why, []
    for texts, source, fields in groups:
        said.append(f"{', '.join(texts)} ({_said(source, fields, why)})")
        if source == DEFAULT:
            why = "the same defaults"  # said once
    return f"{opt.name}: " + "; ".join(said)


def _source(given: Mapping[str, str], *fields: str, otherwise: str = DEFAULT) -> str:
    return next((given[f] for f in fields if f in given), otherwise)


def _said(source: str, fields: list[str], why: str) -> str:
    if source != DEFAULT:
        return SAID[source]
    return f"{why}; set {', '.join(fields)} to change" + (": docs/fine-tuning.md" if why != "the same defaults" else "")


def value(run: RunConfig, field: str) -> Any:
    section, name = field.split(".")
    return getattr(getattr(run, section), name)


def default(run: RunConfig, field: str) -> Any:
    """What `field` is when a user gives nothing: the chosen default, or the section's own."""
    if field in CHOSEN:
        return chosen_for(run).value(field)
    section, name = field.split(".")
    return {f.name: f.default for f in dataclasses.fields(getattr(run, section))}[name]
