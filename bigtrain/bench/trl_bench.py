"""`bigtrain bench --trl`: bigtrain against TRL's own trainers, side by side in one run, one process each.

Each job is a command started by this process, as a user starts it: `bigtrain train --num-gpus 1 ...` or `python -m
bigtrain.bench.baseline_trl` (TRL's trainer); both get the same environment (`hostenv.job_env(1)`). What a job
measured, read the same way for both:

- time to the first step: from just before the command starts to the end of its first optimizer step (the job's
  own `time.time()` there: bigtrain's summary.json `first_step_end_unix`, TRL's `on_step_end`);
- seconds per step: the time between consecutive step ends, the median over steps after `WARMUP`;
- tokens/s: a step's tokens over its seconds, the median over the same steps. SFT and DPO: the records a step
  trains (global batch) x the data's mean tokens per record (`record_tokens`; the same count on both sides, so
  their ratio is that of the step times). GRPO: completions x (the prompts' mean tokens + the step's own mean
  completion length, each side's `completions/mean_length`);
- the same in the job's CPU seconds (its process's `time.process_time()` at each step's end; bigtrain's: the rank's,
  not its `bigtrain train` parent's: about 0.3 s in all, argument checks and relaying the rank's output, since it
  no longer imports torch): each job has one thread, so on a machine other work shares these count the job's own
  work, less its waits for a core.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bigtrain.bench.trl_cases import Case, Workload, bigtrain_sets, trl_job

WARMUP = 2  # steps left out of the medians (the first ones pay one-off costs: op builds, allocator, caches)


def bigtrain_bin() -> str:
    beside = Path(sys.executable).parent / "bigtrain"
    return str(beside) if beside.exists() else (shutil.which("bigtrain") or str(beside))


def command(case: Case, work: Workload, out: Path) -> list[str]:
    if case.runner == "bigtrain":
        return [bigtrain_bin(), "train", *bigtrain_sets(case, work, out)]
    (out / "job.json").write_text(json.dumps(trl_job(case, work, out), indent=1))
    return [sys.executable, "-m", "bigtrain.bench.baseline_trl", "--job", str(out / "job.json"), "--out", str(out)]


def run_case(case: Case, work: Workload, workdir: Path, env: dict, tokens: dict, timeout_s: float = 1800) -> dict:
    """Run the case's command under `workdir/<slug>`; its result, normalised (ok False with the log's tail on a
    failure)."""
    from bigtrain.bench.jobs import _run
    out = Path(workdir) / case.slug
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = command(case, work, out)
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(_repo()), env.get("PYTHONPATH")]))}
    if case.runner == "trl":  # its datasets' tokenized copies start empty, as bigtrain's data cache (under --out)
        env["HF_DATASETS_CACHE"] = str(out / "hf_datasets")
    started = time.time()
    rc, log, wall = _run(cmd, env, timeout_s, out / "log.txt")
    base = {"case": case.name, "objective": case.objective, "runner": case.runner, "setting": case.setting,
            "rc": rc, "wall_s": wall, "command": " ".join(cmd)}
    try:
        read = read_bigtrain if case.runner == "bigtrain" else read_trl
        measured = read(out, started, case, tokens)
    except (OSError, ValueError, KeyError, IndexError) as err:
        return {**base, "ok": False, "error": f"{type(err).__name__}: {err}", "log_tail": log[-3000:]}
    return {**base, **measured, "ok": rc == 0, "log_tail": "" if rc == 0 else log[-3000:]}


def _repo() -> Path:
    from bigtrain.bench.jobs import REPO
    return REPO


def step_seconds(ends: list[float]) -> list[float]:
    """Each step's seconds from the step ends (step 1's needs a start the ends do not have: left out)."""
    return [b - a for a, b in zip(ends, ends[1:])]


def measured(values: list[float], first_step: int = 2) -> list[float]:
    """The values of steps after WARMUP, `values[0]` being step `first_step`'s."""
    skip = max(0, WARMUP + 1 - first_step)
    return values[skip:] if len(values) > skip else values


def rates(step_s: list[float], step_tokens: list[float], step_end_cpu: list[float]) -> dict[str, float]:
    """Medians over the measured steps: seconds, tokens/s, and the process's CPU seconds a step and at the first
    step's end (from its start): on a shared machine, the work itself, less the waits for a core."""
    s, t, cpu = measured(step_s), measured(step_tokens), measured(step_seconds(step_end_cpu))
    return {"step_s": statistics.median(s), "tokens_per_s": statistics.median(n / x for n, x in zip(t, s)),
            "measured_steps": len(s), "cpu_step_s": statistics.median(cpu), "cpu_to_first_step_s": step_end_cpu[0],
            "tokens_per_cpu_s": statistics.median(n / x for n, x in zip(t, cpu))}


def read_bigtrain(out: Path, started: float, case: Case, tokens: dict) -> dict[str, Any]:
    s = json.loads((out / "summary.json").read_text())
    step_s = s["step_times"][1:]  # times[0] runs from the clock's start, not from a step's end
    result = {"time_to_first_step_s": s["first_step_end_unix"] - started, "step_times": step_s,
              "settings": bigtrain_settings(s, case.objective), "lrs": s["lrs"]}
    lengths = [v for _, v in s.get("metrics", {}).get("completions/mean_length", [])][1:]
    result.update(rates(step_s, step_tokens(case, tokens, lengths), s["step_end_cpu_s"]))
    if "time_split" in s:
        from bigtrain.bench.online import step_medians
        result["online"] = step_medians(s, skip=WARMUP)
    return result


def read_trl(out: Path, started: float, case: Case, tokens: dict) -> dict[str, Any]:
    r = json.loads((out / "result.json").read_text())
    ends = r["step_end_unix"]
    step_s = step_seconds(ends)
    lengths = [h["completions/mean_length"] for h in r["log"] if "completions/mean_length" in h][1:]
    return {"time_to_first_step_s": ends[0] - started, "step_times": step_s, "settings": r["settings"],
            "lrs": r["lrs"], "versions": r["versions"],
            "startup": {"imports_s": r["imported"] - started, "trainer_built_s": r["trainer_built"] - started},
            **rates(step_s, step_tokens(case, tokens, lengths), r["step_end_cpu_s"])}


def step_tokens(case: Case, tokens: dict, completion_lengths: list[float]) -> list[float]:
    """Tokens of each step from step 2 on (module docstring)."""
    s = case.settings
    if case.objective == "grpo":
        return [s.global_batch * (tokens["grpo"] + n) for n in completion_lengths]
    return [s.global_batch * tokens[case.objective]] * (s.steps - 1)


def record_tokens(work: Workload) -> dict[str, float]:
    """The data's mean tokens per record, rendered as both sides render it (the chat template; a GRPO prompt is
    plain text): SFT a chat, DPO a pair (prompt + chosen, prompt + rejected), GRPO a prompt."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(work.base))

    def chat(messages: list[dict]) -> int:
        return len(tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])

    def lines(path: Path) -> list[dict]:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    pairs = lines(work.pairs)
    return {"sft": statistics.fmean(chat(r["messages"]) for r in lines(work.chats)),
            "dpo": statistics.fmean(chat(r["prompt"] + r["chosen"]) + chat(r["prompt"] + r["rejected"]) for r in pairs),
            "grpo": statistics.fmean(len(tok(r["prompt"])["input_ids"]) for r in lines(work.prompts))}


def bigtrain_settings(summary: dict, objective: str) -> dict[str, Any]:
    """bigtrain's settings as the run recorded them (run config, the DeepSpeed dict the engine was given), in the
    keys of `baseline_trl.effective_settings`."""
    run, ds = summary["run_config"], summary["ds_config"]
    opt = ds["optimizer"]
    out = {"optimizer": f"{opt['type']}" + (" (torch's)" if opt["params"].get("torch_adam") else " (DeepSpeed's)"),
           "betas": list(opt["params"]["betas"]), "eps": opt["params"]["eps"],
           "weight_decay": opt["params"]["weight_decay"], "grad_clip": ds.get("gradient_clipping", 0.0),
           "lr_scheduler": schedule_text(ds.get("scheduler")), "micro_batch": ds["train_micro_batch_size_per_gpu"],
           "grad_accum": ds["gradient_accumulation_steps"], "processes": summary["world_size"],
           "seed": run["train"]["seed"], "dtype": {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(
               run["precision"], run["precision"]), "zero_stage": ds["zero_optimization"]["stage"]}
    o = run["objective"]
    if objective in ("sft", "dpo"):
        padding = run["data"]["padding"]
        out.update(max_length=run["data"]["seq_len"], packing=run["data"]["packing"],
                   padding="to the batch's longest row" if padding in ("auto", "longest") else "to max length")
    if objective == "sft":
        out["train_on_prompt"] = run["data"]["train_on_prompt"]
    if objective == "dpo":
        out.update(beta=o["beta"], loss_type=["sigmoid"], reference=o["reference"])
    if objective == "grpo":
        out.update({k: o[k] for k in ("beta", "loss_type", "num_generations", "max_completion_length", "temperature",
                                      "top_p", "top_k", "num_iterations", "scale_rewards", "importance_sampling_level",
                                      "mask_truncated_completions")},
                   epsilon_low=o["epsilon"], epsilon_high=o["epsilon_high"] or o["epsilon"],
                   decode={"compact": "compact (ended completions leave the batch)",
                           "generate": "transformers' generate"}[o["decode"]],
                   **generation_batch(o, out["micro_batch"], out["grad_accum"], out["processes"]))
    return out


def generation_batch(objective: dict, micro_batch: int, grad_accum: int, world: int) -> dict[str, int]:
    """TRL's generation_batch_size and steps_per_generation of a bigtrain run (bigtrain.rollout.generation_batch)."""
    from bigtrain.rollout.generation_batch import round_micro_batches
    steps = round_micro_batches(micro_batch, grad_accum, world, objective.get("steps_per_generation"),
                                objective.get("generation_batch_size"))
    return {"steps_per_generation": steps, "generation_batch_size": micro_batch * world * steps}


def schedule_text(scheduler: dict | None) -> str:
    """DeepSpeed's scheduler section in a few words ("constant" where its warm-up starts at its peak)."""
    if not scheduler:
        return "none"
    params = scheduler.get("params", {})
    if scheduler.get("type") == "WarmupLR" and params.get("warmup_min_lr") == params.get("warmup_max_lr"):
        return f"constant (DeepSpeed's WarmupLR, {params['warmup_min_lr']:g} to {params['warmup_max_lr']:g})"
    return f"{scheduler.get('type')} {json.dumps(params)}"


def run_trl_plan(cases: list[Case], workdir: Path, max_minutes: float, log: Any = print, dry: bool = False) -> dict:
    """The workload (made once; `dry`: the tiny one), then every case in order, stopping past `max_minutes`; the
    report the page and the JSON are written from (`trl_report`)."""
    from bigtrain.bench.hostenv import LoadLog, host_facts, job_env
    from bigtrain.bench.trl_cases import make_workload
    start = time.perf_counter()
    work = make_workload(Path(workdir) / "data", dry)
    tokens = record_tokens(work)
    env = job_env(1, extra={"OMP_NUM_THREADS": "1"})
    load, results = LoadLog(), []
    load.sample()
    for i, case in enumerate(cases, 1):
        elapsed = (time.perf_counter() - start) / 60
        if elapsed > max_minutes:
            log(f"[{i}/{len(cases)}] skipped {case.name}: past the {max_minutes:.0f} min budget")
            continue
        busy = load.sample(0.5)
        result = run_case(case, work, workdir, env, tokens, timeout_s=max(120.0, 60 * max_minutes))
        results.append(result)
        log(f"[{i}/{len(cases)} {elapsed:4.1f} min, host {100 * busy:.0f}% busy before] {case.name}: " + (
            f"{result['step_s']:.2f} s/step, {result['tokens_per_s']:.0f} tok/s, first step at "
            f"{result['time_to_first_step_s']:.1f} s" if result["ok"] else f"FAILED {result.get('error') or result['rc']}"))
    meta = {"mode": "trl-dry" if dry else "trl", "host": host_facts(), "load": load.summary(), "minutes": (time.perf_counter() - start) / 60,
            "env": {k: env[k] for k in ("OMP_NUM_THREADS", "GLIBC_TUNABLES") if k in env}, "tokens_per_record": tokens,
            "versions": versions()}
    return {"meta": meta, "results": results}


def versions() -> dict[str, str]:
    from importlib.metadata import version
    return {name: version(name) for name in ("torch", "deepspeed", "transformers", "trl")}
