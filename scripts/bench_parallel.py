"""Measure what tensor and sequence parallelism buy, on this machine's CPU ranks:

1. seq: the longest sequence that trains a Llama shape under a per-rank memory cap, at parallel.sequence 1, 2, 4
   (bisected over multiples of 256; a length "fits" when every rank's peak RSS stays under the cap);
2. tp: model-state bytes and peak RSS per rank of a Llama shape at parallel.tensor 1, 2, 4 (4 ranks each),
   against `bigtrain estimate`'s memory model.

    .venv/bin/python scripts/bench_parallel.py --out docs/bench_parallel.json [--only seq|tp] [--cap-gib 1.6]

Each probe is one short `torchrun ... bigtrain/run.py` job (2 steps, fp32, synthetic tokens); results as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
LLAMA = ["--model", "llama", "--size", "custom", "--set", "model.overrides.n_layer=4",
         "--set", "model.overrides.n_embd=256", "--set", "model.overrides.n_head=8", "--set", "model.overrides.n_kv_head=4",
         "--set", "model.overrides.intermediate_size=704", "--set", "data.vocab_size=512", "--data", "synthetic",
         "--set", "precision=fp32", "--set", "train.sample_tokens=0", "--set", "train.eval_interval=0",
         "--set", "train.eval_batches=0", "--set", "logging.progress_bar=false", "--peak-tflops", "1",
         "--steps", "2", "--set", "batch.micro_batch=1"]


def job(ranks: int, args: list[str], out: Path) -> dict | None:
    """One job; its summary, or None when it failed (out of memory, say)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", str(ranks), "--master_port", str(29500 + os.getpid() % 1000),
           str(REPO / "bigtrain" / "run.py"), "--out", str(out), *LLAMA, *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    summary = out / "summary.json"
    return json.loads(summary.read_text()) if proc.returncode == 0 and summary.is_file() else None


def longest_sequence(sequence: int, cap: float, root: Path) -> dict:
    """Bisect the longest multiple of 256 whose job keeps every rank's peak RSS under `cap` bytes."""
    probes, low, high = [], 0, None
    length = 1024
    while True:
        ranks = max(sequence, 1)
        result = job(ranks, ["--set", f"data.seq_len={length}", "--set", f"parallel.sequence={sequence}",
                             "--set", f"batch.global_batch={ranks // sequence}"], root / f"sp{sequence}_{length}")
        peak = max(r["peak_rss_bytes"] for r in result["peak_memory_per_rank"]) if result else None
        fits = peak is not None and peak <= cap
        probes.append({"seq_len": length, "peak_rss_per_rank": peak, "fits": fits})
        print(f"  sp{sequence} seq {length}: peak {peak and peak / 2**30:.2f} GiB -> {'fits' if fits else 'no'}",
              flush=True)
        if fits:
            low = length
        else:
            high = length
        if high is None:
            length *= 2
        elif high - low <= 256:
            break
        else:
            length = (low + high) // 512 * 256
    return {"sequence": sequence, "longest_seq_len": low, "probes": probes}


def tensor_memory(tensor: int, root: Path) -> dict:
    from bigtrain.config.load import load_run_config
    from bigtrain.estimate.shape import shape_from_spec
    from bigtrain.estimate.memory_model import estimate, setup_from_run
    from bigtrain.models import build
    sets = ["--set", "data.seq_len=512", "--set", f"parallel.tensor={tensor}", "--set", "zero.stage=1",
            "--set", f"batch.global_batch={4 // tensor}"]
    result = job(4, sets, root / f"tp{tensor}")
    run = load_run_config(None, ["model.family=llama", "model.size=custom", "precision=fp32", "zero.stage=1",
                                 "data.seq_len=512", "batch.micro_batch=1", f"batch.global_batch={4 // tensor}",
                                 f"parallel.tensor={tensor}"])
    spec = build("llama", "custom", n_layer=4, n_embd=256, n_head=8, n_kv_head=4, intermediate_size=704,
                 vocab_size=512, seq_len=512)
    predicted = estimate(shape_from_spec(spec, "fp32"), setup_from_run(run, 4, 4))
    return {"tensor": tensor, "model_state_bytes_per_rank": result and result["model_state_bytes_per_rank"],
            "peak_rss_per_rank": result and result["peak_memory_per_rank"],
            "estimated_model_states": predicted.model_states, "estimated_device_peak": predicted.device_peak,
            # what the end-of-run count sees: ZeRO-1/2 free the gradients after every step
            "estimated_after_step": predicted.params + predicted.optimizer}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="docs/bench_parallel.json")
    p.add_argument("--only", choices=["seq", "tp"])
    p.add_argument("--cap-gib", type=float, default=1.6, help="per-rank peak RSS cap for the sequence bisection")
    args = p.parse_args()
    results: dict = {"machine": os.uname().nodename, "cores": os.cpu_count(), "started": time.strftime("%F %T")}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.only in (None, "seq"):
            results["cap_bytes"] = int(args.cap_gib * 2**30)
            results["seq"] = [longest_sequence(s, results["cap_bytes"], root) for s in (1, 2, 4)]
        if args.only in (None, "tp"):
            results["tp"] = [tensor_memory(t, root) for t in (1, 2, 4)]
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results.items() if k != "seq"}, indent=2))
    for row in results.get("seq", []):
        print(f"parallel.sequence={row['sequence']}: longest seq_len under the cap {row['longest_seq_len']}")


if __name__ == "__main__":
    main()
