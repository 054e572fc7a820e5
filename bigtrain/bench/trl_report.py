"""The tables of `bigtrain bench --trl` (docs/benchmarks.md's `trl` section): bigtrain over TRL per objective, every
job, the GRPO step's split, the levers against bigtrain's defaults, and both sides' settings as each ran them."""
from __future__ import annotations

import statistics
from typing import Any

from bigtrain.bench.table import markdown_table
from bigtrain.bench.trl_cases import ENDS_PER_TOKEN, OBJECTIVES, SETTINGS

# (how the page names it, the key of both sides' effective settings)
SETTING_ROWS = (("optimizer", "optimizer"), ("Adam betas", "betas"), ("Adam eps", "eps"),
                ("weight decay", "weight_decay"), ("gradient clipping (max norm)", "grad_clip"),
                ("schedule", "lr_scheduler"), ("rows per micro-batch", "micro_batch"),
                ("micro-batches per step", "grad_accum"), ("processes", "processes"), ("seed", "seed"),
                ("weights' dtype", "dtype"), ("max length", "max_length"), ("padding", "padding"),
                ("packing", "packing"),
                ("beta (DPO: its strength; GRPO: the KL term's weight)", "beta"), ("loss type", "loss_type"), ("reference", "reference"),
                ("completions per prompt", "num_generations"), ("max completion length", "max_completion_length"),
                ("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("decoding", "decode"),
                ("completions per round (generation_batch_size)", "generation_batch_size"),
                ("micro-batches per round (steps_per_generation)", "steps_per_generation"),
                ("clip epsilon (low, high)", ("epsilon_low", "epsilon_high")),
                ("steps over one round (num_iterations)", "num_iterations"), ("scale rewards", "scale_rewards"),
                ("importance sampling level", "importance_sampling_level"),
                ("mask truncated completions", "mask_truncated_completions"))


def ok(results: list[dict], objective: str, runner: str, setting: str = "") -> list[dict]:
    return [r for r in results if r.get("ok") and r["objective"] == objective and r["runner"] == runner
            and r.get("setting", "") == setting]


def pair_ratios(results: list[dict], objective: str, key: str, setting: str = "", against: str = "trl",
                inverse: bool = False) -> list[float]:
    """bigtrain's `key` over the other side's, k-th job with k-th job (the order alternates within each pair); with
    `inverse` theirs over ours (seconds: > 1 is bigtrain faster either way). `against`: "trl", or "defaults"
    (bigtrain's own default jobs: a lever row's gain)."""
    mine = ok(results, objective, "bigtrain", setting)
    theirs = ok(results, objective, "trl") if against == "trl" else ok(results, objective, "bigtrain")
    return [(b[key] / a[key]) if inverse else (a[key] / b[key]) for a, b in zip(mine, theirs)]


KEYS = ("step_s", "tokens_per_s", "time_to_first_step_s", "cpu_step_s", "tokens_per_cpu_s", "cpu_to_first_step_s")


def summary(results: list[dict]) -> list[dict]:
    """Per objective both sides ran: medians of the pairs' ratios (> 1: bigtrain faster / earlier), in wall-clock
    seconds and in the jobs' CPU seconds."""
    out = []
    for objective in OBJECTIVES:
        speed = pair_ratios(results, objective, "tokens_per_s")
        if not speed:
            continue
        med = {side: {k: statistics.median(r[k] for r in rows) for k in KEYS}
               for side, rows in (("bigtrain", ok(results, objective, "bigtrain")), ("trl", ok(results, objective, "trl")))}
        ratios = {"speed": speed, "first_step": pair_ratios(results, objective, "time_to_first_step_s", inverse=True),
                  "cpu_speed": pair_ratios(results, objective, "tokens_per_cpu_s"),
                  "cpu_first_step": pair_ratios(results, objective, "cpu_to_first_step_s", inverse=True)}
        out.append({"objective": objective, **med, **{k: statistics.median(v) for k, v in ratios.items()},
                    **{f"{k}_pairs": v for k, v in ratios.items()}})
    return out


def _pairs(values: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in values)


def ratio_table(records: list[dict]) -> str:
    """Wall clock: what a user waits for."""
    body = [[r["objective"].upper(), f"{r['bigtrain']['step_s']:.2f}", f"{r['trl']['step_s']:.2f}",
             f"{r['bigtrain']['tokens_per_s']:,.0f}", f"{r['trl']['tokens_per_s']:,.0f}", f"**{r['speed']:.2f}x**",
             _pairs(r["speed_pairs"]), f"{r['bigtrain']['time_to_first_step_s']:.1f}",
             f"{r['trl']['time_to_first_step_s']:.1f}", f"**{r['first_step']:.2f}x**", _pairs(r["first_step_pairs"])]
            for r in records]
    return markdown_table(["objective", "bigtrain s/step", "TRL s/step", "bigtrain tokens/s", "TRL tokens/s",
                           "speed, bigtrain / TRL", "pairs", "bigtrain first step s", "TRL first step s",
                           "first step, TRL / bigtrain", "pairs"], body)


def cpu_table(records: list[dict]) -> str:
    """The jobs' own CPU seconds (one thread each): the work, less the waits for a core on a shared machine."""
    body = [[r["objective"].upper(), f"{r['bigtrain']['cpu_step_s']:.2f}", f"{r['trl']['cpu_step_s']:.2f}",
             f"**{r['cpu_speed']:.2f}x**", _pairs(r["cpu_speed_pairs"]), f"{r['bigtrain']['cpu_to_first_step_s']:.1f}",
             f"{r['trl']['cpu_to_first_step_s']:.1f}", f"**{r['cpu_first_step']:.2f}x**",
             _pairs(r["cpu_first_step_pairs"])] for r in records]
    return markdown_table(["objective", "bigtrain CPU s/step", "TRL CPU s/step", "tokens per CPU s, bigtrain / TRL",
                           "pairs", "bigtrain CPU s to first step", "TRL CPU s to first step",
                           "first step, TRL / bigtrain", "pairs"], body)


def jobs_table(results: list[dict]) -> str:
    body = []
    for r in results:
        if not r.get("ok"):
            body.append([r["case"], "failed: " + str(r.get("error") or f"exit {r.get('rc')}")[:80], *[""] * 6])
            continue
        body.append([r["case"], f"{r['step_s']:.2f}", f"{r['tokens_per_s']:,.0f}", f"{r['time_to_first_step_s']:.1f}",
                     f"{r['cpu_step_s']:.2f}", f"{r['cpu_to_first_step_s']:.1f}", f"{r['wall_s']:.0f}",
                     str(r["measured_steps"])])
    return markdown_table(["job (in order)", "s/step", "tokens/s", "first step s", "CPU s/step", "CPU s to first step",
                           "command s", "steps measured"], body)


def split_table(results: list[dict]) -> str:
    """bigtrain's GRPO steps by part (its `time/PART` metrics), with TRL's step beside them."""
    body = []
    for r in (r for r in results if r.get("ok") and r["objective"] == "grpo" and "online" in r):
        o = r["online"]
        body.append([r["case"], f"{r['step_s']:.2f}", *(f"{o['parts_s'][p]:.2f} ({100 * o['shares'][p]:.0f}%)"
                                                        for p in ("generation", "reference", "rewards", "policy")),
                     f"{o['generation_tokens_per_s']:,.0f}", f"{o['mean_completion_length']:.1f}"])
    return markdown_table(["bigtrain GRPO job", "s/step", "generation s", "reference s", "rewards s", "policy s",
                           "generation tokens/s", "mean completion tokens"], body)


def lever_table(results: list[dict]) -> str:
    """Each lever row over bigtrain's default job of the same pair (tokens/s > 1: the row is faster; first step > 1:
    the row starts later)."""
    body = []
    for setting, objective in dict.fromkeys((r["setting"], r["objective"]) for r in results if r.get("setting")):
        speed = pair_ratios(results, objective, "tokens_per_s", setting, against="defaults")
        cpu = pair_ratios(results, objective, "tokens_per_cpu_s", setting, against="defaults")
        first = pair_ratios(results, objective, "time_to_first_step_s", setting, against="defaults")
        cpu_first = pair_ratios(results, objective, "cpu_to_first_step_s", setting, against="defaults")
        if speed:
            body.append([objective.upper(), setting, f"**{statistics.median(speed):.2f}**", _pairs(speed),
                         f"{statistics.median(cpu):.2f}", _pairs(cpu), f"{statistics.median(first):.2f}",
                         _pairs(first), f"{statistics.median(cpu_first):.2f}"])
    return markdown_table(["objective", "bigtrain with", "tokens/s, this row / defaults", "pairs",
                           "tokens per CPU s, this / defaults", "pairs", "time to first step, this / defaults",
                           "pairs", "CPU s to first step, this / defaults"], body)


def _value(settings: dict, key: Any) -> str:
    if isinstance(key, tuple):
        return ", ".join(_value(settings, k) for k in key)
    value = settings.get(key, "-")
    return ", ".join(str(v) for v in value) if isinstance(value, (list, tuple)) else str(value)


def settings_table(results: list[dict], objective: str) -> str:
    """Both sides' settings as each job recorded them, and the rate each applied at its first and last step."""
    mine, theirs = ok(results, objective, "bigtrain"), ok(results, objective, "trl")
    if not (mine and theirs):
        return ""
    a, b = mine[0]["settings"], theirs[0]["settings"]
    body = [[name, _value(a, key), _value(b, key)] for name, key in SETTING_ROWS
            if set(_value(a, key).split(", ")) != {"-"} or set(_value(b, key).split(", ")) != {"-"}]
    body.append(["learning rate applied, first and last step", f"{mine[0]['lrs'][0]:g}, {mine[0]['lrs'][-1]:g}",
                 f"{theirs[0]['lrs'][0]:g}, {theirs[0]['lrs'][-1]:g}"])
    return markdown_table(["setting", "bigtrain (its summary.json)", "TRL (its trainer's objects)"], body)


def section(report: dict) -> str:
    """The page's `trl` section."""
    meta, results = report["meta"], report["results"]
    host, load, v = meta["host"], meta.get("load", {}), meta["versions"]
    s = SETTINGS
    dry = ["**Dry run** (`--dry-run`): a Llama 2 x 64, 3 steps a job, one pair per objective, to check the code "
           "paths: its rates measure nothing."] if meta["mode"] == "trl-dry" else []
    parts = [*dry, 
        f"Measured by `{meta.get('command', 'bigtrain bench --trl')}` on {host['date']} ({meta['minutes']:.0f} min): "
        f"{host['cpu']}, {host['cores']} cores, no GPU; torch {v['torch']}, DeepSpeed {v['deepspeed']}, transformers "
        f"{v['transformers']}, TRL {v['trl']}. Every job is one process with OMP_NUM_THREADS="
        f"{meta['env'].get('OMP_NUM_THREADS')} and GLIBC_TUNABLES={meta['env'].get('GLIBC_TUNABLES', '(unset)')} "
        "(TRL's too), started by the bench as a user starts it; the pairs alternate which side goes first. Host CPU "
        f"busy between jobs (other work on this shared machine): median {100 * load.get('busy_median', 0):.0f}%, "
        f"max {100 * load.get('busy_max', 0):.0f}%: absolute times are noise, the pairs' ratios less so.",
        f"The model: a Llama 4 x 256 (5M parameters, random weights, a 4,096-token BPE with Llama 3's chat "
        f"template), fp32. SFT: {s['sft'].global_batch} chats a step ({s['sft'].micro_batch} x "
        f"{s['sft'].grad_accum}), max length {s['sft'].max_length}, loss on every token (TRL's default). DPO: "
        f"{s['dpo'].global_batch} pairs a step, beta {s['dpo'].beta}, sigmoid loss, a frozen copy as reference. "
        f"GRPO: {s['grpo'].global_batch // s['grpo'].num_generations} prompts x {s['grpo'].num_generations} "
        f"completions of at most {s['grpo'].max_completion_length} tokens a step (the base's end-of-text made "
        f"likely, about 1 in {round(1 / ENDS_PER_TOKEN)} at each token, so that they end at mixed lengths), loss "
        f"{s['grpo'].loss_type}, beta {s['grpo'].beta}, temperature {s['grpo'].temperature}, "
        "reward `accuracy`. Rates: medians over the steps after the first two; tokens/s as "
        "`bigtrain/bench/trl_bench.py` counts them (the same count on both sides).",
        "### bigtrain against TRL",
        "Wall clock, what a user waits for (the pairs: each pair's bigtrain job over its TRL job):",
        ratio_table(summary(results)),
        "The jobs' own CPU seconds (one thread each; bigtrain's: the training process's, not counting its `bigtrain "
        "train` parent's, which checks the arguments, starts it and relays its output): the same work, less the "
        "waits for a core that other work on this machine caused:", cpu_table(summary(results))]
    if any(r.get("setting") for r in results):
        parts += ["### Levers, each against bigtrain's defaults in this run", lever_table(results)]
    if any(r.get("online") for r in results):
        parts += ["### A bigtrain GRPO step, by part", split_table(results)]
    parts += ["### Every job", jobs_table(results)]
    for objective in OBJECTIVES:
        table = settings_table(results, objective)
        if table:
            parts += [f"### {objective.upper()}: the settings each side ran with", table]
    return "\n\n".join(parts)
