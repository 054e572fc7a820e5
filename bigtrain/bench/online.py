"""Online RL's generation throughput, the GPU plan's GRPO cases: a real bigtrain GRPO job on the Llama 3.2
1B shape (random weights, its 128,256-token vocabulary), ZeRO-3 with the weights gathered once per generation round
(`objective.ds3_gather_for_generation=true`) and left partitioned (`false`: every decode step gathers each layer),
`ONLINE_STEPS` steps each. The figures come from the run's own `time/PART` metrics (generation / reference / rewards /
policy seconds of each step): `step_medians` reads them, and scripts/bench_online_rl.py uses it too.

The prompts are arithmetic questions with their answers, written into the job's folder (`Case.prompts`); bigtrain
trains its BPE on them, and the model keeps Llama's full vocabulary (`model.overrides.vocab_size`), so that the
output layer, a large share of a 1B model's decode step, costs what it does in Llama. With random weights a
completion almost never draws its end-of-text: each runs to `objective.max_completion_length`, so gathered and
partitioned decode the same number of tokens.

A dry run (`bigtrain bench --gpu --dry-run`) trains the same cases on a tiny Llama on this host's CPU.
"""
from __future__ import annotations

import json
import random
import statistics
from dataclasses import replace
from pathlib import Path

from bigtrain.bench.cases import PROMPTS_FILE, Case, Strategy, Workload

PARTS = ("generation", "reference", "rewards", "policy")
ONLINE_STEPS = 4  # a warm-up step (the first round pays one-off costs), then three measured
GENERATIONS = 8  # completions per prompt (TRL's default)
GRPO = Workload("llama-1b grpo", "llama", "1b", {"vocab_size": 128256}, seq_len=384, vocab_size=2048, micro_batch=16,
                precision="bf16")
COMPLETION = 256  # tokens a completion decodes: seq_len leaves 128 for the prompt
DRY = replace(GRPO, name="llama-1b grpo (dry)", size="custom", micro_batch=8, seq_len=64, vocab_size=320,
              overrides={"n_layer": 2, "n_embd": 64, "n_head": 2, "n_kv_head": 1, "intermediate_size": 128,
                         "vocab_size": 500})
DRY_COMPLETION = 16
GATHER = {"gathered": "true", "partitioned": "false"}


def online_cases(num_gpus: int, dry: bool = False) -> list[Case]:
    """GRPO at ZeRO-3 with the weights gathered for generation, then left partitioned; 8 prompts x 8 completions a
    step per GPU (the tiny model: 2 x 8), micro-batches of `micro_batch` completions."""
    workload, completion = (DRY, DRY_COMPLETION) if dry else (GRPO, COMPLETION)
    per_gpu = (2 if dry else 8) * GENERATIONS
    sets = (("objective.kind", "grpo"), ("objective.rewards", "[accuracy,length]"),
            ("objective.num_generations", str(GENERATIONS)), ("objective.max_completion_length", str(completion)),
            ("batch.global_batch", str(per_gpu * max(num_gpus, 1))), ("logging.interval", "1"))
    return [Case(workload, Strategy(zero=3), "bigtrain", 3 if dry else ONLINE_STEPS, "online", name,
                 sets=sets + (("objective.ds3_gather_for_generation", gather),), prompts=64 if dry else 512)
            for name, gather in GATHER.items()]


def write_prompts(path: Path, n: int = 256, seed: int = 0) -> Path:
    """`n` arithmetic questions with their answers (what the built-in `accuracy` reward reads), one record a line."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        lines.append(json.dumps({"prompt": f"What is {a} plus {b}? Answer with a number.", "answer": str(a + b)}))
    path.write_text("\n".join(lines) + "\n")
    return path


def step_medians(summary: dict, skip: int = 1) -> dict:
    """From an online run's summary.json (logging.interval 1): each part's median seconds over the steps after
    `skip`, its share of their sum, and generation tokens/s: each step's completion tokens (the global batch counts
    completions) over its generation seconds, the median over those steps."""
    metrics = summary["metrics"]
    medians = {}
    for part in PARTS:
        values = [v for step, v in metrics.get(f"time/{part}", []) if step > skip]
        if not values:
            raise ValueError(f"summary.json has no time/{part} after step {skip}: an online objective logged at "
                             "every step (logging.interval=1) for more steps?")
        medians[part] = statistics.median(values)
    total = sum(medians.values())
    completions = summary["ds_config"]["train_batch_size"]
    lengths = dict((step, v) for step, v in metrics["completions/mean_length"])
    rates = [completions * lengths[step] / s for step, s in metrics["time/generation"] if step > skip and s > 0]
    return {"parts_s": medians, "shares": {p: s / total if total > 0 else 0.0 for p, s in medians.items()},
            "generation_tokens_per_s": statistics.median(rates), "completions_per_step": completions,
            "mean_completion_length": statistics.median(v for step, v in lengths.items() if step > skip)}


def online_table(rows: list[dict]) -> str:
    """Per GRPO job: its step time, generation tokens/s, each part's seconds and share; partitioned over gathered."""
    from bigtrain.bench.table import markdown_table
    body = []
    for r in (r for r in rows if r.get("group") == "online"):
        if not r.get("ok"):
            body.append([r["workload"], r["strategy"], r["setting"], f"failed: {r.get('error', '?')[:60]}", "-", "-",
                         *("-" for _ in PARTS)])
            continue
        o = r["online"]
        gathered = next((g for g in rows if g.get("ok") and g.get("group") == "online" and g["setting"] == "gathered"
                         and g["workload"] == r["workload"]), None)
        against = f"{o['generation_tokens_per_s'] / gathered['online']['generation_tokens_per_s']:.2f}" \
            if gathered else "-"
        body.append([r["workload"], r["strategy"], r["setting"], f"{r['step_s']:.2f}",
                     f"{o['generation_tokens_per_s']:,.0f}", against,
                     *(f"{o['parts_s'][p]:.2f} ({100 * o['shares'][p]:.0f}%)" for p in PARTS)])
    return markdown_table(["model", "strategy", "weights in generation", "step s", "generation tokens/s",
                           "/ gathered", *(f"{p} s" for p in PARTS)], body)
