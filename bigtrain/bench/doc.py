"""The generated parts of docs/benchmarks.md.

The page mixes prose written by people (how to read the numbers, the profile, the settings
that matter) with sections `bigtrain bench` regenerates between markers:

    <!-- bench:sweep begin --> ... <!-- bench:sweep end -->
    <!-- bench:capacity begin --> ... <!-- bench:capacity end -->
    <!-- bench:gpu begin --> ... <!-- bench:gpu end -->

Only the text between a pair of markers is replaced; a missing page starts from a stub.
"""
from __future__ import annotations

import os
from pathlib import Path

from bigtrain.atomic import write_atomic
from bigtrain.bench.levers import lever_ratios
from bigtrain.bench.table import efficiency_table, jobs_table, levers_table, ratio_table, settings_table
from bigtrain.metrics import format_bytes

STUB = """# Benchmarks

Measured by `bigtrain bench` (see the end of this page for how to re-run it).
"""


def replace_section(text: str, name: str, body: str) -> str:
    begin, end = f"<!-- bench:{name} begin -->", f"<!-- bench:{name} end -->"
    block = f"{begin}\n{body.strip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        return head + block + rest.split(end, 1)[1]
    return text.rstrip() + "\n\n" + block + "\n"


def update_page(path: Path, name: str, body: str) -> Path:
    """Write `body` as section `name` of the page at `path` (created from a stub if missing)."""
    path = Path(path)
    text = path.read_text() if path.exists() else STUB
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, replace_section(text, name, body))


def conditions(meta: dict) -> str:
    host, load, peaks = meta["host"], meta.get("load", {}), meta["peaks"]
    amx = "yes" if host["amx"] else "no (bf16 runs on AVX512-BF16)" if host["avx512_bf16"] else "no"
    device = meta.get("device", "cpu")
    sizes = "/".join(str(n) for n in meta.get("peak_sizes", (1024, 2048)))
    where = "" if meta["mode"] == "short" else " and the end"
    lines = [
        f"- Run: `{meta['command']}` on {host['date']}, {meta['minutes']:.1f} min, mode `{meta['mode']}`.",
        f"- Host: {host['cpu']}, {host['cores']} cores, {host['memory_gib']} GiB; AMX: {amx}."
        + ("" if device == "cpu" else f" Accelerator: **{device}**."),
        f"- Every job: {meta['ranks']} rank{'s' if meta['ranks'] > 1 else ''} "
        + ("through the deepspeed launcher" if meta["ranks"] > 1 else "started without a launcher, as `bigtrain "
           "train` starts one") + f", {meta['env_summary']}.",
        f"- Matmul peak per rank, measured in this run by every rank multiplying {sizes} squares at once "
        f"(best rate reached, at the start{where}): "
        + (f"**bf16 {peaks['bf16']:.3f} TFLOP/s, fp32 {peaks['fp32']:.3f} TFLOP/s**" if peaks["bf16"] is not None
           else f"**fp32 {peaks['fp32']:.3f} TFLOP/s**; bf16 not measured: {peaks.get('bf16_not_measured')}"
           + ("" if meta["mode"] == "gpu-dry" else ", so the bf16 workloads trained in fp32"))
        + ("." if device == "cpu" else " (fp32 matmuls as torch runs them by default: no TF32)."),
    ]
    if peaks.get("datasheet_bf16"):
        lines.append(f"- Datasheet dense bf16 peak of the {device}: **{peaks['datasheet_bf16']:.0f} TFLOP/s** "
                     "(`bigtrain.bench.peak.DATASHEET_BF16_TFLOPS`); the *MFU datasheet* column is against it.")
    if load and device == "cpu":
        lines.append(f"- Host CPU busy between jobs (other work on the machine): median {100 * load['busy_median']:.0f}%, "
                     f"max {100 * load['busy_max']:.0f}% over {load['samples']} samples; numbers taken on a busy "
                     "host are noisy, ratios of neighbouring jobs less so.")
    return "\n".join(lines)


LOOP_NOTE = ("*Loop ms/step* is the median step time less DeepSpeed's timed forward, backward and step: "
             "what each runner's loop costs around the engine (data, loss, host syncs, logging).")


def gpu_section(rows: list[dict], ratio_records: list[dict], meta: dict) -> str:
    """The regenerated `gpu` section (`bigtrain bench --gpu`): conditions, ratios, levers, every job."""
    dry = ["**Dry run** (`--dry-run`): the GPU plan's cases on the tiniest GPT-2 for a few steps on this host, to "
           "check the code paths; its rates measure nothing."] if meta["mode"] == "gpu-dry" else []
    parts = [
        *dry, "### Conditions", conditions(meta),
        "### bigtrain against hand-written DeepSpeed and a nanoGPT-style PyTorch loop (same model, data, batch)",
        "Rates are medians over the steps after a 2-step warm-up. The DeepSpeed loop gets bigtrain's DeepSpeed "
        "config; the nanoGPT-style loop (`bigtrain/bench/baseline_nanogpt.py`) is plain PyTorch: torch.compile, "
        "fused AdamW, SDPA, bf16 autocast. Measured jobs run without DeepSpeed's wall-clock breakdown (it "
        "synchronizes the GPU), so there is no fwd / bwd / step split.", ratio_table(ratio_records)]
    levers = lever_ratios(rows)
    if levers:
        parts += ["### Each lever on its own", "bigtrain with one change against its defaults on the same "
                  "workload and strategy in this run: the gain is defaults / row for a default undone, row / "
                  "defaults for an opt-in lever turned on.", levers_table(levers)]
    if any(r.get("group") == "online" for r in rows):
        from bigtrain.bench.online import online_table
        parts += ["### Online RL: GRPO's generation at ZeRO-3, weights gathered or partitioned",
                  "A bigtrain GRPO job per row (bigtrain/bench/online.py): random weights, 8 completions per prompt "
                  "decoding to `objective.max_completion_length`, rewards `accuracy` and `length`. Each part of a "
                  "step is the median over the steps after the first, from the run's own `time/PART` metrics; "
                  "generation tokens/s is a step's completion tokens over its generation seconds.",
                  online_table(rows)]
    if any(r.get("group") == "longest" for r in rows):
        from bigtrain.bench.longest import longest_table
        parts += ["### The longest sequence on one device, every lever on",
                  "Activation checkpointing with the hidden states in host memory, the tiled MLP, the chunked loss, "
                  "ZeRO-3 with the optimizer in host memory, micro-batch 1 (bigtrain/bench/longest.py); Llama-8B "
                  "trains LoRA adapters. Each rung is a job of a few steps; the last column extrapolates the "
                  "measured memory per token to 90% of the device.",
                  longest_table(rows, meta.get("device_bytes"))]
    parts += ["### Every job", "MFU counts the model's FLOPs only, against the bf16 peak measured above; peak "
              "memory is the device's (torch's max allocated).",
              jobs_table(rows, memory_label="peak GPU memory/rank", fp32_mfu=False)]
    return "\n\n".join(parts)


def sweep_section(rows: list[dict], ratio_records: list[dict], meta: dict, images: list[Path], page: Path) -> str:
    """The regenerated `sweep` section: conditions, ratios, efficiency, every job, plots."""
    parts = ["### Conditions", conditions(meta),
             "### bigtrain against the baselines (same model, data, batch, DeepSpeed config, environment)",
             "Rates are medians over the steps after a 2-step warm-up; each bigtrain job ran next to its "
             "baseline (alternating order) to share the machine's state. " + LOOP_NOTE, ratio_table(ratio_records)]
    if any(r.get("group") == "efficiency" for r in rows):
        parts += ["### Efficiency runs", efficiency_table(rows)]
    if any(r.get("group") == "settings" for r in rows):
        parts += ["### What the CPU defaults are worth",
                  "The efficiency workload with one of bigtrain's rank settings undone (core binding: "
                  "`BIGTRAIN_BIND_CORES=0`; malloc tuning: `BIGTRAIN_MALLOC_TUNING=0` and an empty "
                  "`GLIBC_TUNABLES`), between two runs with the defaults.", settings_table(rows)]
    parts += ["### Every job", "MFU counts the model's FLOPs only (no recomputation under activation "
              "checkpointing); model states are counted from the tensors, peak RSS is the process's.",
              jobs_table(rows)]
    if images:
        parts.append("### Plots")
        parts += [f"![{p.stem}]({os.path.relpath(p, Path(page).parent)})" for p in images]
    return "\n\n".join(parts)


def capacity_section(result: dict) -> str:
    """The regenerated `capacity` section from capacity.search_capacity's result."""
    lines = [f"Budget: {format_bytes(result['budget_bytes'])} for the whole job ({result['ranks']} ranks, "
             f"summed peak RSS, enforced by a watchdog), {result['precision']}, micro-batch "
             f"{result['micro_batch']}, sequence {result['seq_len']}, {result['steps']} steps, shape "
             f"{result['shape_rule']}.", ""]
    header = "| strategy | largest that trains | parameters | summed peak RSS | smallest that did not |"
    lines += [header, "|---|---|---|---|---|"]
    for name, found in result["strategies"].items():
        best, fail = found.get("largest"), found.get("smallest_failing")
        lines.append(f"| {name} | {best['label'] if best else 'none'} | "
                     f"{best['num_params'] / 1e6:.0f}M | {format_bytes(best['peak_bytes'])} | "
                     f"{fail['label'] + ' (' + fail['why'] + ')' if fail else '-'} |" if best else
                     f"| {name} | none | - | - | {fail['label'] if fail else '-'} |")
    if result.get("ratios"):  # several strategies against the first
        first = next(iter(result["strategies"]))
        lines += ["", "Parameters over " + first + ": " + ", ".join(
            f"**{name} {ratio:.2f}**" for name, ratio in result["ratios"].items() if name != first) + " (target >= 1.8)."]
    elif result.get("ratio"):
        lines += ["", f"**Ratio of parameters, ZeRO-3 + offload over ZeRO-0: {result['ratio']:.2f}** "
                      f"(target >= 1.8)."]
    for name, sets in (result.get("settings") or {}).items():
        lines += ["", f"{name} ran with " + ", ".join(f"`{k}={v}`" for k, v in sets.items()) + "."]
    lines += ["", "Probes, in order: " + "; ".join(f"{p['strategy']} {p['label']}: {p['outcome']}"
                                                   for p in result["probes"])]
    return "\n".join(lines)
