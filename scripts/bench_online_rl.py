"""What an online-RL step costs on this CPU, measured in one run, as ratios:

1. a GRPO step's time split into generation / reference / rewards / policy (the run's own `time/PART` metrics), on
   one rank and on two (the same global batch), ZeRO-3 with the weights gathered for generation, and on two ranks
   with them left partitioned;
2. generation tokens/s at ZeRO-3 with gathered and with partitioned weights against transformers' `generate` on the
   plain module, same prompts and lengths, greedy (scripts/bench_online_rl_generation.py), on 1 rank and on 2.

    .venv/bin/python scripts/bench_online_rl.py [--out docs/bench_online_rl.json] [--page docs/benchmarks.md]
        [--steps 8] [--rounds 7]
    .venv/bin/python scripts/bench_online_rl.py --from-json docs/bench_online_rl.json   # the page's section again

Every rank runs one thread (OMP_NUM_THREADS=1), on 1 rank too, so that 2 ranks against 1 compares the same per-rank
work (scripts/bench_online_rl_generation.py says why). GRPO: a Llama of 4 layers x 256 wide with random weights
(`--model llama --size custom`), a BPE bigtrain trains on the prompts (arithmetic questions made here, with their answers), the built-in `accuracy` and `length` rewards,
beta 0.04 against a frozen copy (so the reference part is a forward of the copy), 2 prompts x 8 completions of at
most 32 tokens a step, fp32. Each part is the median over the steps after the first (the first pays one-off costs);
generation tokens/s of a step is its completions' tokens over its generation seconds (bigtrain.bench.online's
`step_medians`, which the GPU plan's GRPO cases use too). The page's section sits between `<!-- bench:online_rl
begin -->` and `<!-- bench:online_rl end -->`; the reading of it is written by hand below it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bigtrain.bench.online import PARTS, step_medians, write_prompts

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SHAPE = ["--set", "model.overrides.n_layer=4", "--set", "model.overrides.n_embd=256", "--set",
         "model.overrides.n_head=4", "--set", "model.overrides.n_kv_head=2", "--set",
         "model.overrides.intermediate_size=704"]
GRPO = ["--set", "objective.kind=grpo", "--set", "objective.rewards=[accuracy,length]", "--set",
        "objective.num_generations=8", "--set", "objective.max_completion_length=32", "--set", "objective.beta=0.04",
        "--set", "data.seq_len=64", "--set", "data.vocab_size=1024", "--set", "batch.global_batch=16", "--set",
        "batch.micro_batch=8", "--set", "zero.stage=3", "--set", "precision=fp32", "--set", "optimizer.lr=1e-5",
        "--set", "logging.interval=1", "--set", "train.sample_tokens=0", "--set", "train.eval_interval=0", "--set",
        "train.eval_batches=0", "--set", "logging.progress_bar=false", "--set", "checkpoint.at_end=false",
        "--peak-tflops", "1"]
RUNS = {  # name: (ranks, settings)
    "1 rank, gathered": (1, ["objective.ds3_gather_for_generation=true", "batch.grad_accum=2"]),
    "2 ranks, gathered": (2, ["objective.ds3_gather_for_generation=true", "batch.grad_accum=1"]),
    "2 ranks, partitioned": (2, ["objective.ds3_gather_for_generation=false", "batch.grad_accum=1"]),
}


def grpo_run(root: Path, name: str, prompts: Path, steps: int) -> dict:
    ranks, settings = RUNS[name]
    out = root / name.replace(" ", "_").replace(",", "")
    cmd = [str(BIN / "bigtrain"), "train", "--num-gpus", str(ranks), "--model", "llama", "--size", "custom",
           *SHAPE, "--data", str(prompts), "--steps", str(steps), "--out", str(out), "--overwrite", *GRPO]
    for item in settings:
        cmd += ["--set", item]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread a rank on 1 rank too (the generation worker's note)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    shutil.rmtree(out / "data_cache", ignore_errors=True)
    return {"name": name, "ranks": ranks, **step_medians(summary), "step_s_median": summary["step_s_median"],
            "world_size": summary["world_size"], "run_time_split": summary.get("time_split")}


def generation_run(root: Path, world: int, rounds: int) -> dict:
    out = root / f"generation_{world}.json"
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", str(world),
           str(REPO / "scripts" / "bench_online_rl_generation.py"), str(out), "--rounds", str(rounds)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"generation on {world} rank(s) failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def split_table(runs: list[dict]) -> str:
    from bigtrain.bench.table import markdown_table
    body = [[r["name"], f"{r['step_s_median']:.2f}",
             *(f"{r['parts_s'][p]:.2f} ({100 * r['shares'][p]:.0f}%)" for p in PARTS),
             f"{r['generation_tokens_per_s']:.0f}"] for r in runs]
    return markdown_table(["GRPO run (ZeRO-3)", "step s (median)", *(f"{p} s" for p in PARTS),
                           "generation tokens/s"], body)


def generation_table(reports: list[dict]) -> str:
    from bigtrain.bench.table import markdown_table
    base = {r["world"]: r["tokens_per_s"]["plain"] for r in reports}
    one = next((r for r in reports if r["world"] == 1), None)
    body = []
    for r in reports:
        for mode, label in (("plain", "transformers' generate, plain module"), ("gathered", "ZeRO-3, gathered"),
                            ("partitioned", "ZeRO-3, partitioned")):
            rate = r["tokens_per_s"][mode]
            against_one = f"{rate / one['tokens_per_s'][mode]:.2f}" if one and r is not one else "1.00" if one else "-"
            cpu, wall = statistics.median(r["cpu_seconds"][mode]), statistics.median(r["seconds"][mode])
            body.append([f"{r['world']} x {r['threads_per_rank']} thread", label, f"{rate:.0f}",
                         f"{rate / base[r['world']]:.2f}", against_one, f"{cpu / wall:.2f}",
                         f"{r['tokens_per_round'] / cpu:.0f}", "yes" if r["same_tokens_as_plain"][mode] else "**no**"])
    return markdown_table(["ranks", "generation", "tokens/s (median)", "/ plain", "/ 1 rank",
                           "busiest rank's CPU s / wall s", "tokens per CPU s of the busiest rank", "same tokens"],
                          body)


def section(results: dict) -> str:
    gen = results["generation"][0]
    shape = gen["shape"]
    return "\n\n".join([
        f"Measured {results['started']} UTC by `scripts/bench_online_rl.py` on {results['host']} "
        f"({results['cores']} cores, no GPU; load average {results['load_before']} before and "
        f"{results['load_after']} after: other jobs shared the machine), DeepSpeed {results['deepspeed']}, torch "
        f"{results['torch']}, transformers {results['transformers']}. Raw results: "
        "[bench_online_rl.json](bench_online_rl.json). Absolute times on this shared host are noise; compare rows.",
        f"**A GRPO step, by part.** {results['steps']} steps each, medians over steps 2-{results['steps']}: "
        "Llama 4 x 256 (random weights), 2 prompts x 8 completions of at most 32 tokens a step, beta 0.04 against a "
        "frozen copy, rewards `accuracy` and `length`, fp32, ZeRO-3; the same global batch on 1 and 2 ranks.",
        split_table(results["grpo"]),
        f"**Generation alone.** {gen['prompts']} prompts of {gen.get('prompt_lengths', '8-24')} tokens, "
        f"{gen['new_tokens']} new tokens each (an end-of-text no prompt reaches, so every mode decodes them all), "
        f"greedy, Llama {shape['num_hidden_layers']} x {shape['hidden_size']} vocab {shape['vocab_size']}; median "
        f"of {gen['rounds']} rounds alternating the modes' order, each round the slowest rank's time; 2 ranks split "
        "the prompts. ZeRO-3 keeps no layer whole (`stage3_param_persistence_threshold` 0).",
        generation_table(results["generation"])])


def write_section(page: Path, results: dict) -> None:
    from bigtrain.bench.doc import update_page
    update_page(page, "online_rl", section(results))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO / "docs" / "bench_online_rl.json"))
    p.add_argument("--page", default=str(REPO / "docs" / "benchmarks.md"))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=7, help="timed generation rounds per mode")
    p.add_argument("--from-json", metavar="FILE", help="rewrite the page's section from saved results")
    args = p.parse_args()
    if args.from_json:
        write_section(Path(args.page), json.loads(Path(args.from_json).read_text()))
        return
    import deepspeed
    import torch
    import transformers
    results: dict = {"started": time.strftime("%F %H:%M", time.gmtime()), "host": os.uname().nodename,
                     "cores": os.cpu_count(), "load_before": f"{os.getloadavg()[0]:.1f}", "steps": args.steps,
                     "deepspeed": deepspeed.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__, "grpo": [], "generation": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prompts = write_prompts(root / "prompts.jsonl")
        for world in (1, 2):
            results["generation"].append(generation_run(root, world, args.rounds))
            print(json.dumps(results["generation"][-1]["tokens_per_s"]), flush=True)
        for name in RUNS:
            results["grpo"].append(grpo_run(root, name, prompts, args.steps))
            print(json.dumps(results["grpo"][-1]), flush=True)
    results["load_after"] = f"{os.getloadavg()[0]:.1f}"
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    write_section(Path(args.page), results)
    print(section(results))


if __name__ == "__main__":
    main()
