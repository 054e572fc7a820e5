"""Markdown tables of a sweep: every job, bigtrain against the baselines, and the efficiency runs."""
from __future__ import annotations

from typing import Any

from bigtrain.metrics import format_bytes, human_count

RATIO_TARGET = 0.98


def _rate(row: dict) -> str:
    if row.get("tokens_per_s"):
        return f"{human_count(row['tokens_per_s'])} tok/s"
    return f"{row['samples_per_s']:.1f} samples/s"


def _split(row: dict) -> str:
    split = row.get("split_ms") or {}
    parts = [f"{split[k]:.0f}" if k in split else "-" for k in ("forward", "backward", "step")]
    return " / ".join(parts) if split else "-"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def jobs_table(rows: list[dict], memory_label: str = "peak RSS/rank", fp32_mfu: bool = True) -> str:
    """Every job of the sweep, failed ones included (with their error). On a GPU the fp32 peak (no TF32)
    says nothing about bf16 jobs: `fp32_mfu=False` leaves that column out."""
    header = ["workload", "precision", "strategy", "runner", "throughput", "TFLOP/s", "MFU bf16 peak",
              "MFU fp32 peak", "model states/rank", memory_label, "fwd / bwd / step ms"]
    body = []
    for r in rows:
        runner = r["runner"] + (f" ({r['setting']})" if r.get("group") == "lever" else "")
        if not r.get("ok"):
            body.append([r["workload"], r["precision"], r["strategy"], runner, f"failed: {r.get('error', '?')[:60]}",
                         *["-"] * 6])
            continue
        body.append([r["workload"], r["precision"], r["strategy"], runner, _rate(r), f"{r['tflops']:.3f}",
                     _pct(r["mfu_bf16"]), _pct(r["mfu_fp32"]), format_bytes(r["model_state_bytes"]),
                     format_bytes(r["peak_rss_bytes"]), _split(r)])
    if not fp32_mfu:
        header, body = header[:7] + header[8:], [row[:7] + row[8:] for row in body]
    if any(r.get("mfu_datasheet") is not None for r in rows):  # a listed GPU: MFU against its datasheet too
        at = header.index("MFU bf16 peak") + 1
        header.insert(at, "MFU datasheet")
        for line, r in zip(body, rows):
            line.insert(at, _pct(r.get("mfu_datasheet")) if r.get("ok") else "-")
    return markdown_table(header, body)


def ratio_table(records: list[dict]) -> str:
    """bigtrain / hand-written DeepSpeed (target >= 0.98) and bigtrain / DDP, from rows.ratios()."""
    header = ["workload", "strategy", "bigtrain", "hand-written DeepSpeed", "bigtrain / DeepSpeed (median of pairs)",
              "pairs", "ratio of medians", "loop ms/step, bigtrain vs DeepSpeed", "DDP", "bigtrain / DDP"]
    body = []
    nanogpt = any(rec.get("nanogpt") for rec in records)
    for rec in records:
        scale = rec["tokens_per_sample"] or 1
        unit = "tok/s" if rec["tokens_per_sample"] else "samples/s"
        verdict = "ok" if rec["ratio"] >= RATIO_TARGET else f"below {RATIO_TARGET}"
        body.append([rec["workload"], rec["strategy"], f"{human_count(rec['bigtrain'] * scale)} {unit}",
                     f"{human_count(rec['deepspeed'] * scale)} {unit}", f"**{rec['ratio']:.3f}** ({verdict})",
                     _pairs(rec), f"{rec.get('ratio_of_medians', rec['ratio']):.3f}", _loop(rec),
                     f"{human_count(rec['ddp'] * scale)} {unit}" if rec["ddp"] else "-",
                     f"{rec['vs_ddp']:.2f}" if rec["vs_ddp"] else "-"])
        if nanogpt:
            body[-1] += [f"{human_count(rec['nanogpt'] * scale)} {unit}" if rec.get("nanogpt") else "-",
                         f"{rec['vs_nanogpt']:.2f}" if rec.get("vs_nanogpt") else "-"]
    if nanogpt:
        header += ["nanoGPT-style PyTorch", "bigtrain / nanoGPT"]
    return markdown_table(header, body)


def levers_table(records: list[dict]) -> str:
    """Each lever measured on its own (levers.lever_ratios): the row, bigtrain's defaults, the lever's gain."""
    header = ["lever", "what it does", "workload", "strategy", "this row", "bigtrain's defaults", "gain of the lever",
              "peak memory/rank"]
    body = [[f"{r['lever']}", r["what"], r["workload"], r["strategy"], f"{human_count(r['rate'])} {r['unit']}",
             f"{human_count(r['defaults'])} {r['unit']}", f"**x{r['gain']:.2f}**",
             format_bytes(r["peak_memory"]) if r.get("peak_memory") else "-"] for r in records]
    return markdown_table(header, body)


def _pairs(rec: dict) -> str:
    pairs = rec.get("pair_ratios") or []
    return ", ".join(f"{x:.3f}" for x in pairs) if pairs else "-"


def _loop(rec: dict) -> str:
    mine, theirs = rec.get("loop_ms_bigtrain"), rec.get("loop_ms_deepspeed")
    return "-" if mine is None or theirs is None else f"{mine:.1f} vs {theirs:.1f}"


def efficiency_table(rows: list[dict]) -> str:
    """The efficiency runs: MFU against the peak of their own precision, and against the other."""
    header = ["workload", "precision", "strategy", "throughput", "TFLOP/s (job)", "MFU bf16 peak", "MFU fp32 peak",
              "fwd / bwd / step ms"]
    body = [[r["workload"], r["precision"], r["strategy"], _rate(r), f"{r['tflops']:.3f}", _pct(r["mfu_bf16"]),
             _pct(r["mfu_fp32"]), _split(r)]
            for r in rows if r.get("ok") and r["group"] == "efficiency" and r["runner"] == "bigtrain"]
    return markdown_table(header, body)


def settings_table(rows: list[dict]) -> str:
    """The settings runs: each against the mean of the two runs with bigtrain's defaults."""
    runs = [r for r in rows if r.get("ok") and r["group"] == "settings"]
    defaults = [r["samples_per_s"] for r in runs if r["setting"] in ("defaults", "defaults, again")]
    if not defaults:
        return "(no run with the defaults finished)"
    base = sum(defaults) / len(defaults)
    header = ["workload", "precision", "strategy", "ranks' environment", "throughput", "MFU", "vs defaults",
              "peak RSS/rank"]
    body = [[r["workload"], r["precision"], r["strategy"], r["setting"], _rate(r), _pct(r["mfu"]),
             f"{r['samples_per_s'] / base:.3f}", format_bytes(r["peak_rss_bytes"])] for r in runs]
    return markdown_table(header, body)
