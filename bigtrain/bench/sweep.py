"""The sweeps: which jobs run, in which order, and what comes out of them.

`short` (CI, ~1 min): tiny GPT-2 and ResNet, a few steps, bigtrain against both baselines.
`full` (~45 min on 2 cores with 6 pairs per stage): a GPT-2 workload at ZeRO 0-3, each stage run next to the
hand-written DeepSpeed loop (alternating which goes first, so drift hits both alike), the DDP
loop, offload / activation checkpointing / pipeline variants, the efficiency runs at the
largest GPT-2 that runs comfortably, and ResNet-18.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from bigtrain.atomic import write_atomic
from bigtrain.bench.cases import Case, Strategy, Workload
from bigtrain.bench.hostenv import LoadLog, host_facts, job_env
from bigtrain.bench.jobs import REPO, Launch, run_case
from bigtrain.bench.levers import BY_NAME, lever_cases
from bigtrain.bench.longest import longest_cases
from bigtrain.bench.online import online_cases
from bigtrain.bench.peak import datasheet_bf16_tflops, read_peaks
from bigtrain.bench.rows import check_rows, make_row, ratios

RATIO_STEPS = 22  # 2 warm-up + 20 measured: the ratio is a median of >= 20 steps
SWEEP_STEPS = 12

Z = {stage: Strategy(zero=stage) for stage in range(4)}


@dataclass
class Plan:
    mode: str
    cases: list[Case] = field(default_factory=list)
    ranks: int = 2  # ranks per job: 2 on a CPU host, one per GPU on a GPU host
    repeats: int = 1  # bigtrain / DeepSpeed pairs per ZeRO stage


def ratio_pairs(w: Workload, stages: tuple[int, ...], steps: int, repeats: int = 1) -> list[Case]:
    """bigtrain and the DeepSpeed loop per stage, alternating which runs first."""
    cases = []
    for rep in range(repeats):
        for i, stage in enumerate(stages):
            pair = [Case(w, Z[stage], "bigtrain", steps, "ratio"), Case(w, Z[stage], "deepspeed", steps, "ratio")]
            cases += pair if (i + rep) % 2 == 0 else pair[::-1]
    return cases


def short_plan() -> Plan:
    gpt2 = Workload("gpt2-tiny", "gpt2", "custom", {"n_layer": 2, "n_embd": 64, "n_head": 2}, seq_len=64,
                    vocab_size=512, micro_batch=2, precision="bf16")
    resnet = Workload("resnet-tiny", "resnet", "tiny", {}, image_size=32, micro_batch=4, precision="fp32")
    steps = 6
    return Plan("short", [*ratio_pairs(gpt2, (1,), steps), Case(gpt2, Z[0], "ddp", steps, "ratio"),
                          Case(resnet, Z[3], "bigtrain", steps, "sweep")])


# The GPT-2 the sweep runs every strategy on: GPT-2's vocabulary and a short sequence, small
# enough for ~1 s steps on one core per rank.
SWEEP_GPT2 = Workload("gpt2-4x256", "gpt2", "custom", {"n_layer": 4, "n_embd": 256, "n_head": 4}, seq_len=128,
                      micro_batch=4, precision="bf16")
# The largest GPT-2 that runs comfortably on one core per rank (~4 s steps): GPT-2 "mini".
EFFICIENCY_GPT2 = Workload("gpt2-mini", "gpt2", "mini", {}, seq_len=256, micro_batch=4, precision="bf16")
RESNET = Workload("resnet18-32px", "resnet", "18", {"cifar_stem": True}, image_size=32, micro_batch=8,
                  precision="fp32")


FULL_REPEATS = 6  # job-to-job noise on a shared 2-core VM is +-5%: one pair per stage says little
GPU_REPEATS = 1  # ~22 jobs of ~1 min with compiling on one H100; --repeats 2 for a second pair of each


def full_plan(repeats: int = FULL_REPEATS) -> Plan:
    w = SWEEP_GPT2
    cases = [*ratio_pairs(w, (0, 1, 2, 3), RATIO_STEPS, repeats), Case(w, Z[1], "ddp", RATIO_STEPS, "ratio")]
    for strategy in (Strategy(1, checkpointing=True), Strategy(2, "optimizer"), Strategy(3, "all"),
                     Strategy(3, "all", checkpointing=True), Strategy(0, pipeline=2), Strategy(1, pipeline=2)):
        cases.append(Case(w, strategy, "bigtrain", SWEEP_STEPS, "sweep"))
    fp32 = Workload("gpt2-mini (fp32)", "gpt2", "mini", {}, seq_len=256, micro_batch=4, precision="fp32")
    for workload, stage in ((EFFICIENCY_GPT2, 1), (EFFICIENCY_GPT2, 2), (fp32, 1)):
        cases.append(Case(workload, Z[stage], "bigtrain", SWEEP_STEPS, "efficiency"))
    for strategy in (Z[0], Z[1], Z[3], Strategy(1, checkpointing=True), Strategy(1, pipeline=2)):
        cases.append(Case(RESNET, strategy, "bigtrain", SWEEP_STEPS, "sweep"))
    return Plan("full", cases + settings_cases(EFFICIENCY_GPT2, Z[1]), repeats=repeats)


# GPT-2 small and medium as they are trained: GPT-2's vocabulary padded to 50304 rows (bigtrain's default
# on a GPU), 1024 tokens, bf16; and the Llama 3.2 1B shape (its 128,256-token vocabulary), 2048 tokens.
GPU_WORKLOADS = (Workload("gpt2-small", "gpt2", "small", {}, seq_len=1024, micro_batch=16, precision="bf16",
                          vocab_multiple=64),
                 Workload("gpt2-medium", "gpt2", "medium", {}, seq_len=1024, micro_batch=8, precision="bf16",
                          vocab_multiple=64))
GPU_LLAMA = Workload("llama-1b", "llama", "1b", {}, seq_len=2048, vocab_size=128256, micro_batch=8, precision="bf16")
GPU_STEPS = 40  # steps take ~0.1-0.3 s on one H100: 38 measured after the warm-up
DRY_STEPS = 3  # --dry-run: enough for the 2-step warm-up and one measured step
GPU_STAGES = (1, 2, 3)
# The tiniest model of each family standing in for a GPU workload in a dry run.
DRY_SHAPES = {"gpt2": {"n_layer": 2, "n_embd": 64, "n_head": 2},
              "llama": {"n_layer": 2, "n_embd": 64, "n_head": 2, "n_kv_head": 1, "intermediate_size": 128}}


def dry_workload(w: Workload) -> Workload:
    """The tiniest model of `w`'s family standing in for it in a dry run (same runners, strategies and levers,
    on a CPU)."""
    return replace(w, name=f"{w.name} (dry)", size="custom", overrides=DRY_SHAPES[w.family], seq_len=64,
                   vocab_size=500, micro_batch=2)


def gpu_plan(num_gpus: int, repeats: int = GPU_REPEATS, dry: bool = False) -> Plan:
    """GPT-2 small and medium at ZeRO 1-3, each bigtrain job next to the hand-written DeepSpeed loop, the
    nanoGPT-style PyTorch loop, each lever on its own (levers.LEVERS) on GPT-2 small, the Llama 1B shape's
    MFU, GRPO's generation throughput at ZeRO-3 (`online`), and on one GPU the longest sequences of Llama-1B and
    Llama-8B with every lever on (`longest`); one rank per GPU.

    The cases come in the order of what a short GPU lease should measure first (the bench stops at
    --max-minutes): GPT-2 small at ZeRO-1 beside both loops, GPT-2 medium at ZeRO-1 beside DeepSpeed's, the
    default levers undone, Llama 1B, then ZeRO-2/3 and the opt-in levers, then further pairs (`repeats`).

    `dry`: every case of that plan but the CUDA-only ones, on the tiniest models for DRY_STEPS steps, one
    rank on this host's device (a CPU): the GPU path's code runs between GPU sessions without a GPU."""
    if dry:
        num_gpus, repeats, steps = 1, 1, DRY_STEPS
    elif num_gpus < 1:
        raise ValueError("bigtrain bench --gpu needs a GPU: torch sees none here (run the CPU sweep without --gpu, "
                         "or --gpu --dry-run to check the GPU plan's code paths on this host)")
    else:
        steps = GPU_STEPS
    small, medium = (dry_workload(w) if dry else w for w in GPU_WORKLOADS)
    llama = dry_workload(GPU_LLAMA) if dry else GPU_LLAMA
    levers = lever_cases(small, steps, num_gpus, on_cpu=dry)
    undone = [c for c in levers if not BY_NAME[c.setting].on]

    def trio(w: Workload) -> list[Case]:
        return [*ratio_pairs(w, (1,), steps), Case(w, Z[1], "nanogpt", steps, "ratio")]

    cases = trio(small)
    if not dry:  # dry: medium would be the same tiny model as small
        cases += ratio_pairs(medium, (1,), steps)
    cases += [*undone, Case(llama, Z[1], "bigtrain", steps, "efficiency"), *ratio_pairs(small, (2, 3), steps)]
    if not dry:
        cases.append(Case(medium, Z[1], "nanogpt", steps, "ratio"))
    cases += [c for c in levers if c not in undone]
    if not dry:
        cases += ratio_pairs(medium, (2, 3), steps)
    for _ in range(repeats - 1):
        for w in (small,) if dry else (small, medium):
            cases += ratio_pairs(w, GPU_STAGES, steps) + [Case(w, Z[1], "nanogpt", steps, "ratio")]
    cases += online_cases(num_gpus, dry)  # GRPO's generation, weights gathered and partitioned
    if num_gpus == 1:  # the longest sequence one device trains with every lever on: long steps, so last
        cases += longest_cases(dry)
    return Plan("gpu-dry" if dry else "gpu", cases, ranks=num_gpus, repeats=repeats)


# What each of bigtrain's CPU defaults is worth: the efficiency job with one of them undone.
NO_MALLOC_TUNING = (("BIGTRAIN_MALLOC_TUNING", "0"), ("GLIBC_TUNABLES", ""))
SETTINGS = {
    "no core binding": (("BIGTRAIN_BIND_CORES", "0"),),
    "no malloc tuning": NO_MALLOC_TUNING,
    "neither": (("BIGTRAIN_BIND_CORES", "0"), *NO_MALLOC_TUNING),
    "neither, 2 threads per rank": (("BIGTRAIN_BIND_CORES", "0"), ("OMP_NUM_THREADS", "2"), *NO_MALLOC_TUNING),
}


def settings_cases(workload: Workload, strategy: Strategy) -> list[Case]:
    """The defaults, then each setting undone, then the defaults again (drift shows as their difference)."""
    default = Case(workload, strategy, "bigtrain", SWEEP_STEPS, "settings", "defaults")
    variants = [Case(workload, strategy, "bigtrain", SWEEP_STEPS, "settings", name, env)
                for name, env in SETTINGS.items()]
    return [default, *variants, Case(workload, strategy, "bigtrain", SWEEP_STEPS, "settings", "defaults, again")]


def measure_peaks(workdir: Path, launch: Launch, name: str = "peak", seconds: float = 1.0) -> Path:
    """Run the peak job (launched like the others); returns the directory with the ranks' files."""
    from bigtrain.bench.jobs import _run, remove_shm_leftovers
    from bigtrain.distributed.rendezvous import free_port
    from bigtrain.launch.node import machine_command
    out = Path(workdir) / name
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd, launcher_vars = machine_command(launch.num_ranks, port, ["bigtrain.bench.peak", "--out", str(out),
                                                                  "--seconds", str(seconds)], module=True)
    try:
        pythonpath = os.pathsep.join(filter(None, [str(REPO), launch.env.get("PYTHONPATH")]))
        rc, log, _ = _run(cmd, {**launch.env, **launcher_vars, "PYTHONPATH": pythonpath}, 300, out / "log.txt")
    finally:
        remove_shm_leftovers(port)
    if rc != 0:
        raise RuntimeError(f"peak measurement failed ({rc}):\n{log[-2000:]}")
    return out


def run_plan(plan: Plan, workdir: Path, max_minutes: float, log: Callable[[str], None] = print) -> dict:
    """Peaks, then every case in order (stopping early past `max_minutes`); rows and conditions."""
    start = time.perf_counter()
    gpu_mode = plan.mode.startswith("gpu")  # measured GPU jobs run without DeepSpeed's synchronizing timers
    launch = Launch(job_env(plan.ranks), num_ranks=plan.ranks, timeout_s=max(120.0, 60 * max_minutes),
                    breakdown=not gpu_mode)
    load = LoadLog()
    load.sample()
    seconds = 0.3 if plan.mode in ("short", "gpu-dry") else 1.0
    peak_dirs = [measure_peaks(workdir, launch, "peak_start", seconds)]
    peaks = _with_datasheet(read_peaks(*peak_dirs))
    log(f"peak per rank: {peaks_line(peaks)}")
    if peaks["bf16"] is None and plan.mode != "gpu-dry":  # the dry run's subject is the GPU plan's bf16 code path
        plan = replace(plan, cases=in_fp32(plan.cases))
        log("the bf16 workloads train in fp32 here: bf16 would run in software, many times slower")
    results = []
    for i, case in enumerate(plan.cases, 1):
        elapsed = (time.perf_counter() - start) / 60
        if elapsed > max_minutes:
            log(f"[{i}/{len(plan.cases)}] skipped {case.name}: past the {max_minutes:.0f} min budget")
            continue
        busy = load.sample(0.5)
        peak = peaks["fp32" if case.workload.precision == "fp32" else "bf16"]
        # A job that hangs must not eat the rest of a short (GPU) budget: it ends a minute and a half past it.
        left_s = 60 * max_minutes - (time.perf_counter() - start)
        job_launch = replace(launch, timeout_s=min(launch.timeout_s, max(90.0, left_s + 90.0)))
        try:
            result = run_case(case, workdir, job_launch, peak_tflops=peak)
        except (ValueError, OSError, RuntimeError) as err:  # a case bigtrain cannot set up: one failed row
            result = {"case": case.name, "runner": case.runner, "workload": case.workload.name,
                      "strategy": case.strategy.label, "group": case.group, "precision": case.workload.precision,
                      "setting": case.setting, "ok": False, "error": f"{type(err).__name__}: {err}"}
        results.append(result)
        save_results({"results": results, "peaks": peaks}, Path(workdir) / "results_so_far.json")
        row = make_row(result, peaks)
        log(f"[{i}/{len(plan.cases)} {elapsed:4.1f} min, host {100 * busy:.0f}% busy before] {case.name}: "
            + row_line(row, case.workload.precision))
    if plan.mode not in ("short", "gpu-dry"):  # again at the end: a busy host only lowers a measurement
        peak_dirs.append(measure_peaks(workdir, launch, "peak_end", seconds))
        peaks = _with_datasheet(read_peaks(*peak_dirs))
        log(f"peak per rank, best of start and end: {peaks_line(peaks)}")
    rows = [make_row(r, peaks) for r in results]
    first = peaks["per_rank"][0]
    meta = {"mode": plan.mode, "host": host_facts(), "load": load.summary(), "peaks": peaks, "ranks": plan.ranks,
            "device": first.get("device", "cpu"), "peak_sizes": first.get("sizes", [1024, 2048]),
            "device_bytes": device_bytes(),
            "minutes": (time.perf_counter() - start) / 60, "command": _command(plan),
            "env_summary": env_summary(launch.env, first.get("device", "cpu"))}
    return {"meta": meta, "results": results, "rows": rows, "ratios": ratios(rows), "problems": check_rows(rows, peaks)}


def row_line(row: dict, precision: str) -> str:
    """What the console says of a finished job: its rate and MFU (none without a peak of its precision)."""
    if not row["ok"]:
        return f"FAILED {row['error']}"
    mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None else "- (no peak measured)"
    return f"{row['samples_per_s']:.2f} samples/s, MFU {mfu} ({precision})"


def peaks_line(peaks: dict) -> str:
    """`bf16 0.090 TFLOP/s, fp32 0.176 TFLOP/s`, or why bf16 was not measured."""
    bf16 = f"bf16 {peaks['bf16']:.3f} TFLOP/s" if peaks["bf16"] is not None else \
        f"bf16 not measured ({peaks.get('bf16_not_measured')})"
    return f"{bf16}, fp32 {peaks['fp32']:.3f} TFLOP/s"


def in_fp32(cases: list[Case]) -> list[Case]:
    """`cases` with their bf16 workloads trained in fp32 (a device without native bf16), less a case that then
    repeats one of the plan's fp32 cases under another workload name (the efficiency runs' fp32 twin)."""
    def same(a: Case, b: Case) -> bool:
        return replace(a, workload=replace(a.workload, name="")) == replace(b, workload=replace(b.workload, name=""))
    fp32 = [c for c in cases if c.workload.precision == "fp32"]
    out = []
    for case in cases:
        if case.workload.precision == "bf16":
            case = replace(case, workload=replace(case.workload, precision="fp32"))
            if any(same(case, twin) for twin in fp32):
                continue
        out.append(case)
    return out


def device_bytes() -> float:
    """Memory of one device of this host (a GPU's, or the host's on a CPU): what the longest rungs extrapolate to."""
    from deepspeed.accelerator import get_accelerator
    return float(get_accelerator().total_memory())


def _with_datasheet(peaks: dict) -> dict:
    """The measured peaks, and the datasheet's dense bf16 peak of the device the ranks ran on (None: unlisted)."""
    device = peaks["per_rank"][0].get("device", "cpu")
    return {**peaks, "datasheet_bf16": datasheet_bf16_tflops(device)}


def _command(plan: Plan) -> str:
    if plan.mode == "gpu-dry":
        return "bigtrain bench --gpu --dry-run"
    return f"bigtrain bench --{plan.mode}" + ("" if plan.mode == "short" else f" --repeats {plan.repeats}")


def env_summary(env: dict, device: str = "cpu") -> str:
    bind = "each rank pinned to its own core (bigtrain.distributed.host.bind_to_cores)" \
        if env.get("BIGTRAIN_BIND_CORES", "1") != "0" else "no core binding"
    if device != "cpu":
        bind = f"one {device} per rank"
    return (f"OMP_NUM_THREADS={env.get('OMP_NUM_THREADS')}, GLIBC_TUNABLES={env.get('GLIBC_TUNABLES', '(unset)')}, "
            f"{bind}")


def save_results(report: dict, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, json.dumps(report, indent=1, default=str))
