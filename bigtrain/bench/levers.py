"""The GPU speed levers (compile, the chunked loss, the padded vocabulary, ...), each measured on its own by
`bigtrain bench --gpu`.

A lever row is bigtrain at one workload and strategy with a single change against its defaults: a
default lever undone ("compile off": what compiling gains is defaults / this row) or an opt-in lever
turned on ("deepcompile": this row / defaults). The defaults are the bigtrain rows of the ratio pairs
on the same workload (or `Case.base`) and strategy, run in the same session.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Any, Callable

from bigtrain.bench.cases import Case, Strategy, Workload


@dataclass(frozen=True)
class Lever:
    name: str  # the row's setting label
    what: str  # what the lever does, for the table
    sets: tuple[tuple[str, Any], ...] = ()  # run-config overrides of the row
    ds_sets: tuple[tuple[str, Any], ...] = ()  # DeepSpeed-config keys of the row
    on: bool = False  # True: the row turns an opt-in lever on; False: the row undoes a default
    workload: Callable[[Workload], Workload] | None = None  # the row trains another model (vocabulary)
    stages: tuple[int, ...] = (1,)
    cuda_only: bool = False  # cannot run on a CPU host (the dry run leaves it out)


def _unpadded(w: Workload) -> Workload:
    return replace(w, name=f"{w.name} (vocab {w.vocab_size})", vocab_multiple=1)


LEVERS = (
    Lever("compile off", "torch.compile of model and loss together (`train.compile`, DeepSpeed's engine.compile)",
          sets=(("train.compile", "false"),)),
    Lever("plain loss", "chunked causal-LM loss, no full fp32 logits (`train.loss_impl`)",
          sets=(("train.loss_impl", "plain"),)),
    Lever("overflow check on", "bf16 without DeepSpeed's per-step overflow check (`bf16.check_grad_overflow: false`)",
          ds_sets=(("bf16.check_grad_overflow", True),)),
    Lever("vocabulary unpadded", "vocabulary padded to a multiple of 64 (`model.overrides.vocab_multiple`)",
          workload=_unpadded),
    Lever("micro_batch auto", "largest micro-batch that fits, global batch kept by accumulation "
          "(`batch.micro_batch=auto`, global batch 4x the defaults')", on=True),
    Lever("compile at ZeRO-3", "torch.compile at ZeRO-3, where `train.compile: auto` leaves it off (DeepSpeed's "
          "hooks run eagerly between compiled pieces)", sets=(("train.compile", "true"),), on=True, stages=(3,)),
    Lever("deepcompile", "DeepSpeed's DeepCompile (`train.compile=deepcompile`)",
          sets=(("train.compile", "deepcompile"),), on=True, stages=(1, 2, 3), cuda_only=True),
)
BY_NAME = {lever.name: lever for lever in LEVERS}


def lever_cases(w: Workload, steps: int, ranks: int, on_cpu: bool = False) -> list[Case]:
    """One bigtrain row per lever (and stage) on workload `w`; CUDA-only levers left out `on_cpu`."""
    cases = []
    for lever in LEVERS:
        if lever.cuda_only and on_cpu:
            continue
        sets = lever.sets
        if lever.name == "micro_batch auto":
            sets = (("batch.micro_batch", "auto"), ("batch.global_batch", str(4 * w.micro_batch * ranks)))
        workload = lever.workload(w) if lever.workload else w
        for stage in lever.stages:
            cases.append(Case(workload, Strategy(zero=stage), "bigtrain", steps, "lever", lever.name,
                              sets=tuple(sets), ds_sets=lever.ds_sets, base=w.name))
    return cases


def lever_ratios(rows: list[dict]) -> list[dict]:
    """Per lever row: its rate, the median rate of bigtrain's defaults on the base workload and strategy, and
    the lever's gain (defaults / row for a default undone, row / defaults for an opt-in turned on)."""
    records = []
    for row in rows:
        if row.get("group") != "lever" or not row.get("ok"):
            continue
        base = [r["tokens_per_s"] or r["samples_per_s"] for r in rows
                if r.get("ok") and r.get("group") == "ratio" and r["runner"] == "bigtrain"
                and r["workload"] == row.get("base_workload") and r["strategy"] == row["strategy"]]
        if not base:
            continue
        lever = BY_NAME.get(row["setting"])
        mine, defaults = row["tokens_per_s"] or row["samples_per_s"], statistics.median(base)
        records.append({"lever": row["setting"], "what": lever.what if lever else "", "workload": row["workload"],
                        "strategy": row["strategy"], "rate": mine, "defaults": defaults,
                        "unit": "tok/s" if row["tokens_per_s"] else "samples/s",
                        "gain": mine / defaults if lever and lever.on else defaults / mine,
                        "peak_memory": row.get("peak_rss_bytes")})
    return records
