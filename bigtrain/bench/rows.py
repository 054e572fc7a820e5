"""One row per finished job: rates, achieved TFLOP/s, MFU against both measured peaks, memory,
the step split, and the ratios against the baselines run on the same workload and strategy."""
from __future__ import annotations

import math
import statistics
from typing import Any

SANE_MFU = (0.0, 1.0)


def make_row(result: dict, peaks: dict) -> dict[str, Any]:
    """Derived numbers of one job (`result` from jobs.run_case, `peaks` from peak.read_peaks)."""
    row = {k: result[k] for k in ("case", "runner", "workload", "strategy", "group", "precision", "ok")}
    row["setting"] = result.get("setting", "bigtrain's defaults")
    row["base_workload"] = result.get("base_workload", result["workload"])
    if not result.get("ok"):
        # a rung of the longest-sequence ladder that does not fit is what the ladder looks for
        out_of_memory = "out of memory" in (result.get("log_tail") or "").lower()
        return {**row, "error": result.get("error") or f"exit code {result.get('rc')}", "out_of_memory": out_of_memory}
    world = result["world_size"]
    sps = result["samples_per_s"]
    tflops = result["flops_per_sample"] * sps / 1e12
    row.update(
        samples_per_s=sps, tokens_per_s=sps * result["tokens_per_sample"] if result["tokens_per_sample"] else None,
        step_s=result["step_s_median"], tflops=tflops, world_size=world, global_batch=result["global_batch"],
        num_params=result["num_params"], tokens_per_sample=result["tokens_per_sample"],
        mfu_bf16=_share(tflops, peaks["bf16"], world), mfu_fp32=_share(tflops, peaks["fp32"], world),
        # against the peak of the precision it trained in (fp16 matmuls: no peak measured, use bf16's); None where
        # that peak was not measured (bf16 on a device without native bf16)
        mfu=_share(tflops, peaks["fp32" if result["precision"] == "fp32" else "bf16"], world),
        # against the device's datasheet dense bf16 peak (peak.datasheet_bf16_tflops), where it is listed
        mfu_datasheet=tflops / (peaks["datasheet_bf16"] * world) if peaks.get("datasheet_bf16") else None,
        model_state_bytes=max(result["model_state_bytes_per_rank"]),
        peak_rss_bytes=max(result["peak_rss_per_rank"]),
        split_ms=result.get("split_ms") or {}, final_loss=result["losses"][-1] if result["losses"] else None,
    )
    row["loop_ms"] = loop_overhead_ms(row["step_s"], row["split_ms"])
    if "online" in result:  # an online-RL job: its step's parts and generation tokens/s (bench/online.py)
        row["online"] = result["online"]
    return row


def _share(tflops: float, peak_per_rank: float | None, world: int) -> float | None:
    return tflops / (peak_per_rank * world) if peak_per_rank else None


def loop_overhead_ms(step_s: float, split_ms: dict) -> float | None:
    """Median step time less DeepSpeed's timed forward, backward and step: what the loop around
    the engine costs (data, loss, logging, host syncs). None without the split (pipelines)."""
    if not all(k in split_ms for k in ("forward", "backward", "step")):
        return None
    return 1e3 * step_s - sum(split_ms[k] for k in ("forward", "backward", "step"))


def ratios(rows: list[dict]) -> list[dict]:
    """bigtrain's rate over the hand-written DeepSpeed loop's, per workload and strategy, and over the
    DDP loop's on the same workload. One record per workload and strategy that both runners ran.

    `ratio` is the median over pairs of bigtrain / DeepSpeed, a pair being the k-th job of each
    runner (the sweep runs them back to back): each pair shares the host's state, which on a
    shared machine drifts by more than the 2% being measured. `ratio_of_medians` is kept beside it.
    """
    rates: dict[tuple, list[float]] = {}
    for r in rows:
        if r.get("ok") and r.get("group") != "lever":  # lever rows change one thing: not bigtrain's defaults
            rates.setdefault((r["workload"], r["strategy"], r["runner"]), []).append(r["samples_per_s"])
    ddp = {w: statistics.median(v) for (w, _, runner), v in rates.items() if runner == "ddp"}
    nanogpt = {w: statistics.median(v) for (w, _, runner), v in rates.items() if runner == "nanogpt"}
    records = []
    for (workload, strategy, runner), values in rates.items():
        ds = rates.get((workload, strategy, "deepspeed"))
        if runner != "bigtrain" or not ds:
            continue
        mine, theirs = statistics.median(values), statistics.median(ds)
        pairs = pair_ratios(rows, workload, strategy)
        loop = {name: _median_loop_ms(rows, workload, strategy, name) for name in ("bigtrain", "deepspeed")}
        records.append({"workload": workload, "strategy": strategy, "bigtrain": mine, "deepspeed": theirs,
                        "loop_ms_bigtrain": loop["bigtrain"], "loop_ms_deepspeed": loop["deepspeed"],
                        "ratio": statistics.median(pairs) if pairs else mine / theirs, "pair_ratios": pairs,
                        "ratio_of_medians": mine / theirs, "jobs": len(values) + len(ds), "ddp": ddp.get(workload),
                        "vs_ddp": mine / ddp[workload] if workload in ddp else None,
                        "nanogpt": nanogpt.get(workload),
                        "vs_nanogpt": mine / nanogpt[workload] if workload in nanogpt else None,
                        "tokens_per_sample": next(r["tokens_per_sample"] for r in rows
                                                  if r.get("ok") and r["workload"] == workload)})
    return records


def pair_ratios(rows: list[dict], workload: str, strategy: str) -> list[float]:
    """bigtrain / DeepSpeed for each k-th job of the two runners where both finished."""
    def runs(runner: str) -> list[dict]:
        return [r for r in rows if (r["workload"], r["strategy"], r["runner"]) == (workload, strategy, runner)
                and r.get("group") != "lever"]
    return [a["samples_per_s"] / b["samples_per_s"] for a, b in zip(runs("bigtrain"), runs("deepspeed"))
            if a.get("ok") and b.get("ok")]


def _median_loop_ms(rows: list[dict], workload: str, strategy: str, runner: str) -> float | None:
    values = [r["loop_ms"] for r in rows if r.get("ok") and r.get("loop_ms") is not None and r.get("group") != "lever"
              and (r["workload"], r["strategy"], r["runner"]) == (workload, strategy, runner)]
    return statistics.median(values) if values else None


def check_rows(rows: list[dict], peaks: dict) -> list[str]:
    """Problems that make a table meaningless: failed jobs, non-finite or non-positive numbers,
    MFU (against the peak of the job's own precision) outside (0, 1], baselines that trained
    a different model. Empty when all is sane."""
    problems = []
    for name in ("bf16", "fp32"):
        if name == "bf16" and peaks.get("bf16") is None and peaks.get("bf16_not_measured"):
            continue  # a device without native bf16: not measured, and said so
        if not (isinstance(peaks.get(name), (int, float)) and math.isfinite(peaks[name]) and peaks[name] > 0):
            problems.append(f"{name} peak {peaks.get(name)} is not a positive number")
    for row in rows:
        if not row.get("ok"):
            if not (row.get("group") == "longest" and row.get("out_of_memory")):
                problems.append(f"{row['case']}: failed ({row.get('error', '?')})")
            continue
        for key in ("samples_per_s", "tflops", "step_s", "model_state_bytes", "peak_rss_bytes"):
            value = row[key]
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                problems.append(f"{row['case']}: {key}={value} is not a positive finite number")
        if row["mfu"] is not None and not SANE_MFU[0] < row["mfu"] <= SANE_MFU[1]:
            problems.append(f"{row['case']}: MFU {row['mfu']:.3f} against the {row['precision']} peak is outside (0, 1]")
        if row["final_loss"] is None or not math.isfinite(row["final_loss"]):
            problems.append(f"{row['case']}: final loss {row['final_loss']} is not finite")
    problems += _same_models(rows)
    return problems


def _same_models(rows: list[dict]) -> list[str]:
    """Every runner of a workload must have trained a model of the same size (a fairness check)."""
    sizes: dict[str, set[int]] = {}
    for row in rows:
        if row.get("ok"):
            sizes.setdefault(row["workload"], set()).add(row["num_params"])
    return [f"{w}: runners trained models of different sizes {sorted(s)}" for w, s in sizes.items() if len(s) > 1]
