"""What data.packing buys on chat data: real (not padding) tokens per second, packed vs unpacked, in A B A B order.

    .venv/bin/python scripts/bench_packing.py [--out docs/bench_packing.json] [--steps 30] [--pairs 2]

Chat data made here: 2,000 conversations whose user turns and answers are spans of Python's reference docs
(pydoc_data) of varied length (answers 8-400 words, log-uniform), a byte-level BPE trained on the same text with
Llama 3's special tokens and chat template. A 4-layer Llama shape (256 wide) trains on one rank at seq_len 512,
micro-batch 8, fp32, the peak given (so no run measures it), once unpacked and once packed per pair. The figure is
`summary.json`'s `real_tokens_per_s` (tokens/s x (1 - padding share)) and the padding shares; both runs see the
same examples, in rows of different counts.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bigtrain from this checkout
from bigtrain.bench.chat_data import make_data, make_pairs  # noqa: E402,F401  (gpu_journeys, bench_preference)


def bigtrain_command() -> str:
    """The `bigtrain` console script: beside this Python (a venv), else on PATH (a machine without the venv)."""
    import shutil
    beside = Path(sys.executable).parent / "bigtrain"
    return str(beside) if beside.exists() else (shutil.which("bigtrain") or str(beside))


# The CPU measurement: a 4-layer Llama shape (256 wide) in fp32 on one rank, the peak given (no run measures it).
CPU_SETS = ("model.overrides.n_layer=4", "model.overrides.n_embd=256", "model.overrides.n_head=4",
            "model.overrides.n_kv_head=2", "model.overrides.intermediate_size=704", "data.seq_len=512",
            "precision=fp32", "batch.micro_batch=8", "batch.global_batch=8")


def run(root: Path, data: Path, tok: Path, packed: bool, steps: int, name: str, sets: tuple[str, ...] = CPU_SETS,
        peak_tflops: float = 1.0, timeout_s: float = 1800) -> dict:
    out = root / name
    args = [bigtrain_command(), "train", "--num-gpus", "1", "--model", "llama", "--size", "custom", "--data", str(data),
            "--set", f"data.tokenizer={tok}", "--steps", str(steps),
            "--set", "train.eval_interval=0", "--set", "train.eval_batches=0", "--set", "train.sample_tokens=0",
            "--set", "logging.progress_bar=false", "--set", "checkpoint.at_end=false",
            "--peak-tflops", str(peak_tflops), "--set", f"data.packing={str(packed).lower()}", "--out", str(out)]
    for item in sets:
        args += ["--set", item]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    d = summary["data"]
    return {"name": name, "packed": packed, "tokens_per_s": summary["tokens_per_s"],
            "real_tokens_per_s": d["real_tokens_per_s"], "pad_share": d["pad_share"], "train_rows": d["train_rows"],
            "train_examples": d["train_examples"], "step_s_median": summary["step_s_median"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="docs/bench_packing.json")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--pairs", type=int, default=2)
    args = p.parse_args()
    results: dict = {"started": time.strftime("%F %T"), "steps": args.steps, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data, tok = make_data(root)
        for pair in range(args.pairs):
            for packed in (False, True):
                row = run(root, data, tok, packed, args.steps, f"{'packed' if packed else 'unpacked'}{pair}")
                results["runs"].append(row)
                print(json.dumps(row))
    by = {k: [r["real_tokens_per_s"] for r in results["runs"] if r["packed"] == k] for k in (False, True)}
    results["ratio_real_tokens_per_s"] = [b / a for a, b in zip(by[False], by[True])]
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print("packed / unpacked real tokens/s per pair:", ", ".join(f"{r:.2f}" for r in results["ratio_real_tokens_per_s"]))


if __name__ == "__main__":
    main()
