"""Whole groups of an objective's samples on every rank (`Needs.samples_per_record`: a prompt's num_generations
completions for online RL), checked on the batch a job trains at its world size: before any rank starts
(`bigtrain.train.precheck`, with the world size the launcher will start), on the ranks (`bigtrain.train.job`) and by
`bigtrain lint`. The line names a fix only after checking it: each one, given as `--set` beside everything the user
gave (the other batch sizes, a DeepSpeed JSON, the world size, a resumed checkpoint's batch), resolves here to a
batch that holds whole groups.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Mapping

from bigtrain.config.run_config import RunConfig
from bigtrain.ds.lint import DeviceCaps
from bigtrain.ds.mapping import with_fields
from bigtrain.ds.resolve import resolve
from bigtrain.objectives import batch_problem

TRIES = 6  # values tried per kind of fix: the nearest first


def group_problem(run: RunConfig, user_json: dict | str | Path | None, world_size: int,
                  sources: Mapping[str, str] | None, *, resume_batch: int | None = None,
                  ds_config: dict | None = None, device: DeviceCaps | None = None) -> str | None:
    """One line when the batch `run` trains at `world_size` (its resolved DeepSpeed dict: `ds_config`, or resolved
    here) gives a rank part of a group, with the fixes that were checked to hold; None when every rank holds whole
    groups."""
    needs = run.objective.declared
    if needs.samples_per_record < 2:
        return None
    device = device or DeviceCaps("cpu", fp16=True, bf16=True)  # the batch does not depend on the device's kernels
    resolving = {"user_json": user_json, "world_size": world_size, "device": device, "resume_batch": resume_batch}
    if ds_config is None:
        ds_config = resolve(run, user_json, world_size, device, sources=sources, resume_batch=resume_batch).ds_config
    if batch_problem(run.objective.kind, needs, ds_config=ds_config) is None:
        return None
    fixes = [" and ".join(f"{field}={value}" for field, value in fix.items())
             for fix in checked_fixes(run, dict(sources or {}), ds_config, resolving)]
    return batch_problem(run.objective.kind, needs, ds_config=ds_config, fixes=fixes)


def checked_fixes(run: RunConfig, sources: dict[str, str], ds_config: dict, resolving: dict) -> list[dict[str, Any]]:
    """Up to three fixes, each of another kind (the accumulation, the micro-batch, the group), each checked by
    resolving the run with it."""
    found = []
    for candidates in (_accumulations(run, sources, ds_config), _micro_batches(run, sources, ds_config),
                       _groups(run, ds_config)):
        fix = next((c for c in candidates if _holds(run, sources, c, resolving)), None)
        if fix is not None:
            found.append(fix)
    return found


def _holds(run: RunConfig, sources: dict[str, str], fix: dict[str, Any], resolving: dict) -> bool:
    """Whether `run` with `fix` given as --set resolves (at the same world size, beside the same JSON and
    checkpoint) to a batch of whole groups."""
    try:
        fixed = with_fields(run, fix)
        resolved = resolve(fixed, resolving["user_json"], resolving["world_size"], resolving["device"],
                           sources={**sources, **dict.fromkeys(fix, "--set")}, resume_batch=resolving["resume_batch"])
    except ValueError:  # the batch cannot be solved with it, or the run refuses it: not a fix
        return False
    return batch_problem(fixed.objective.kind, fixed.objective.declared, ds_config=resolved.ds_config) is None


def _triple(ds_config: dict) -> tuple[int, int, int]:
    micro, accum = ds_config["train_micro_batch_size_per_gpu"], ds_config["gradient_accumulation_steps"]
    return micro, accum, ds_config["train_batch_size"] // (micro * accum)


def _near(value: int, ok: Any) -> Iterator[int]:
    """Positive integers meeting `ok`, nearest `value` first (the larger of two as near: more samples, never
    fewer than asked), at most TRIES of them."""
    found = 0
    for step in range(1, 64 * value + 64):
        for candidate in (value + step, value - step):
            if candidate > 0 and ok(candidate):
                yield candidate
                found += 1
                if found == TRIES:
                    return


def _accumulations(run: RunConfig, sources: dict[str, str], ds_config: dict) -> Iterator[dict[str, Any]]:
    """The micro-batch kept (the memory a rank needs), the accumulation changed; said as the global batch when the
    user gave one (the accumulation is then derived)."""
    micro, accum, dp = _triple(ds_config)
    group = run.objective.declared.samples_per_record
    for steps in _near(accum, lambda k: micro * k % group == 0):
        yield {"batch.global_batch": micro * steps * dp} if "batch.global_batch" in sources \
            else {"batch.grad_accum": steps}


def _micro_batches(run: RunConfig, sources: dict[str, str], ds_config: dict) -> Iterator[dict[str, Any]]:
    """The accumulation kept, the micro-batch changed (and the global batch with it, when the user gave one)."""
    micro, accum, dp = _triple(ds_config)
    group = run.objective.declared.samples_per_record
    for size in _near(micro, lambda m: m * accum % group == 0):
        fix: dict[str, Any] = {"batch.micro_batch": size}
        if "batch.global_batch" in sources:
            fix["batch.global_batch"] = size * accum * dp
        yield fix


def _groups(run: RunConfig, ds_config: dict) -> Iterator[dict[str, Any]]:
    """The batch kept, the group changed to a size that divides each rank's samples (where a setting decides it)."""
    micro, accum, _ = _triple(ds_config)
    needs = run.objective.declared
    if not needs.samples_setting:
        return
    for size in _near(needs.samples_per_record, lambda n: n > 1 and micro * accum % n == 0):
        yield {needs.samples_setting: size}
