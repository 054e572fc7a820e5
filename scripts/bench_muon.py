"""Muon against AdamW on the same model, data and steps: a report, not a claim.

    .venv/bin/python scripts/bench_muon.py --out docs/bench_muon.json

One rank each, ZeRO-1, fp32, a tiny Llama on the built-in corpus (Python's docs, a 4096-token BPE), the same seed,
batches and cosine schedule; AdamW at bigtrain's defaults (lr 6e-4), Muon at DeepSpeed's defaults for its half
(muon_lr 0.02, momentum 0.95) with the same AdamW settings for the embeddings, head and norms. Each run's training
losses and its validation losses come from its summary.json.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMON = ["--model", "llama", "--size", "tiny", "--set", "data.seq_len=128", "--set", "batch.micro_batch=8",
          "--set", "precision=fp32", "--set", "zero.stage=1", "--set", "logging.progress_bar=false",
          "--set", "train.sample_tokens=0", "--set", "checkpoint.at_end=false", "--peak-tflops", "1"]
RUNS = {"adamw": [], "muon": ["--set", "optimizer.name=muon"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="docs/bench_muon.json")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--root", default="/tmp/bench_muon")
    args = p.parse_args()
    results = {"command": " ".join(sys.argv), "steps": args.steps, "runs": {}}
    for name, extra in RUNS.items():
        out = Path(args.root) / name
        start = time.time()
        cmd = [sys.executable, str(REPO / "bigtrain" / "run.py"), "--out", str(out), "--overwrite", *COMMON,
               "--steps", str(args.steps), "--set", f"train.eval_interval={args.steps // 6}", *extra]
        subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True,
                       env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
                            "PYTHONPATH": str(REPO)})
        summary = json.loads((out / "summary.json").read_text())
        results["runs"][name] = {"seconds": round(time.time() - start), "losses": summary["losses"],
                                 "val": summary.get("val_losses") or summary.get("eval"),
                                 "optimizer": summary["ds_config"]["optimizer"]}
        print(name, "last losses", [round(x, 3) for x in summary["losses"][-5:]], flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
