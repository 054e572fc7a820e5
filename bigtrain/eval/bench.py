"""`python -m bigtrain.eval.bench`: evaluation requests/s of `bigtrain eval` against lm-eval's own runner on the same
model directory and tasks, and of 2 ranks against 1 (the figures in docs/benchmarks.md).

The workload is made here, offline: a Llama with random weights (the rate does not depend on them) and a BPE
trained on Python's docs, and a local task folder over the same docs: a 4-way multiple-choice task (which
continuation of a sentence is the real one) and a rolling-perplexity task over whole paragraphs. Each variant runs
`--repeats` times, interleaved (a shared machine drifts; ratios come from the same rounds):
  lm_eval         `lm_eval --model hf --model_args pretrained=DIR ...`, lm-eval's command, wall clock
  bigtrain        `bigtrain eval DIR ...`, one rank, wall clock and its evaluation phase
  bigtrain_2      `bigtrain eval DIR --num-gpus 2 ...`, wall clock and its evaluation phase
  lm_eval_phase   lm-eval's HFLM on the directory and `simple_evaluate` in a python process: the phase alone
Every variant runs the same requests at the same batch size; requests/s = requests / seconds. Each process gets
`--threads` threads (OMP_NUM_THREADS, default 1): one core per rank, the CPU's stand-in for one GPU per rank, so
"2 ranks against 1" is 2 cores against 1 and bigtrain against lm-eval is core for core. (On a shared 2-core VM a
single process with 2 threads is at the mercy of every other job: one descheduled thread stalls the other at each
parallel region.)
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PHASE = """
import json, sys, time
from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
model_dir, tasks, folder, batch = sys.argv[1:5]
manager = TaskManager(include_path=folder, include_defaults=False)
lm = HFLM(pretrained=model_dir, batch_size=int(batch), device="cpu")
started, cpu = time.perf_counter(), time.process_time()
simple_evaluate(model=lm, tasks=tasks.split(","), task_manager=manager, log_samples=False)
print(json.dumps({"seconds": time.perf_counter() - started, "cpu_s": time.process_time() - cpu}))
"""
TASKS = "bench_mc,bench_ppl"


def make_workload(root: Path, docs: int, hidden: int, layers: int) -> tuple[Path, Path, int]:
    """(model directory, task folder, number of requests) under `root`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bigtrain.data.builtin import builtin_documents
    from bigtrain.data.tokenizer import train_bpe
    texts = builtin_documents()
    tok = train_bpe(texts, 4096)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                                         num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                                         max_position_embeddings=1024, tie_word_embeddings=False))
    model_dir = root / "model"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    folder = root / "tasks"
    folder.mkdir()
    paragraphs = [p.strip() for t in texts for p in t.split("\n\n") if len(p.split()) >= 24]
    rng = random.Random(0)
    rng.shuffle(paragraphs)
    with (folder / "mc.jsonl").open("w") as f:
        for p in paragraphs[:docs]:
            words = p.split()
            endings = [" ".join(words[12:20])] + [" ".join(rng.choice(paragraphs).split()[12:20]) for _ in range(3)]
            f.write(json.dumps({"context": " ".join(words[:12]), "choices": endings, "label": 0}) + "\n")
    with (folder / "ppl.jsonl").open("w") as f:
        for p in paragraphs[docs:docs + docs // 4]:
            f.write(json.dumps({"text": p[:1500]}) + "\n")
    for name, data, body in (
            ("bench_mc", "mc.jsonl", "output_type: multiple_choice\ndoc_to_text: \"{{context}}\"\n"
                                     "doc_to_choice: \"{{choices}}\"\ndoc_to_target: label\n"
                                     "metric_list:\n  - metric: acc\n"),
            ("bench_ppl", "ppl.jsonl", "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\n"
                                       "doc_to_target: \"{{text}}\"\nmetric_list:\n  - metric: word_perplexity\n")):
        (folder / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / data}\n"
            f"test_split: test\n{body}")
    return model_dir, folder, 4 * docs + docs // 4


def run_variant(name: str, model_dir: Path, folder: Path, batch: int, work: Path, threads: int) -> dict:
    """One timed run of a variant: {"wall_s", "phase_s" (where the variant reports it)}."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": str(threads)}
    binary = Path(sys.executable).parent
    out = work / f"{name}.json"
    if name == "lm_eval":
        cmd = [str(binary / "lm_eval"), "--model", "hf", "--model_args", f"pretrained={model_dir}", "--tasks", TASKS,
               "--include_path", str(folder), "--device", "cpu", "--batch_size", str(batch),
               "--output_path", str(work / "lm_eval_out")]
    elif name == "lm_eval_phase":
        cmd = [sys.executable, "-c", PHASE, str(model_dir), TASKS, str(folder), str(batch)]
    else:
        cmd = [sys.executable, "-m", "bigtrain.cli", "eval", str(model_dir), "--tasks", TASKS, "--include-path",
               str(folder), "--batch-size", str(batch), "--out", str(out)]
        cmd += ["--num-gpus", "2"] if name == "bigtrain_2" else []
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    if name == "lm_eval_phase":
        phase = json.loads(proc.stdout.strip().splitlines()[-1])
        return {"phase_s": phase["seconds"], "phase_cpu_s": phase["cpu_s"]}
    if name.startswith("bigtrain"):
        info = json.loads(out.read_text())["bigtrain"]
        return {"wall_s": wall, "phase_s": info["seconds"], "phase_cpu_s": info["cpu_s"]}  # rank 0's
    return {"wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bigtrain.eval.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=200, help="multiple-choice documents (a quarter as many paragraphs "
                                                         "for the perplexity task)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="threads per process (per rank)")
    p.add_argument("--out", default="docs/bench_eval.json")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bigtrain_eval_bench_"))
    try:
        model_dir, folder, requests = make_workload(work, args.docs, args.hidden, args.layers)
        variants = ["lm_eval", "bigtrain", "bigtrain_2", "lm_eval_phase"]
        rounds = []
        for r in range(args.repeats):
            rounds.append({name: run_variant(name, model_dir, folder, args.batch_size, work, args.threads)
                           for name in variants})
            print(f"round {r + 1}: {json.dumps(rounds[-1])}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = summarize(rounds, requests)
    result["setup"] = {**vars(args), "requests": requests, "cpus": os.cpu_count(), "python": sys.version.split()[0]}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return 0


def summarize(rounds: list[dict], requests: int) -> dict:
    """Medians over the rounds, and ratios taken within each round (then their median)."""
    def med(name: str, key: str) -> float:
        return statistics.median(r[name][key] for r in rounds)

    def ratio(a: tuple[str, str], b: tuple[str, str]) -> float:
        return statistics.median(r[b[0]][b[1]] / r[a[0]][a[1]] for r in rounds)
    rate = {f"{n} {k}": requests / med(n, k) for n, k in (("lm_eval", "wall_s"), ("bigtrain", "wall_s"),
                                                          ("bigtrain_2", "wall_s"), ("lm_eval_phase", "phase_s"),
                                                          ("bigtrain", "phase_s"), ("bigtrain_2", "phase_s"),
                                                          ("lm_eval_phase", "phase_cpu_s"),
                                                          ("bigtrain", "phase_cpu_s"), ("bigtrain_2", "phase_cpu_s"))}
    return {"rounds": rounds, "requests_per_s": rate,
            "ratios": {"bigtrain / lm_eval, command wall clock": ratio(("bigtrain", "wall_s"), ("lm_eval", "wall_s")),
                       "bigtrain / lm_eval, evaluation phase": ratio(("bigtrain", "phase_s"),
                                                                     ("lm_eval_phase", "phase_s")),
                       "bigtrain / lm_eval, evaluation phase CPU seconds": ratio(("bigtrain", "phase_cpu_s"),
                                                                                 ("lm_eval_phase", "phase_cpu_s")),
                       "2 ranks / 1 rank, evaluation phase": ratio(("bigtrain_2", "phase_s"), ("bigtrain", "phase_s")),
                       "2 ranks / 1 rank, evaluation phase CPU seconds of rank 0": ratio(
                           ("bigtrain_2", "phase_cpu_s"), ("bigtrain", "phase_cpu_s")),
                       "2 ranks / 1 rank, command wall clock": ratio(("bigtrain_2", "wall_s"), ("bigtrain", "wall_s"))}}


def table(result: dict) -> str:
    lines = ["| what | requests/s |", "|---|---:|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in result["requests_per_s"].items()]
    lines += ["", "| ratio (median of per-round ratios; > 1: the first is faster) | |", "|---|---:|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in result["ratios"].items()]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
