"""What a preference step costs against a fine-tuning step: tokens/s of SFT, DPO with each kind of reference
(a frozen copy, precomputed log-probabilities, LoRA's adapters off) and ORPO (no reference), on one rank, alternating in rounds so drift hits every runner alike.

    .venv/bin/python scripts/bench_preference.py [--out docs/bench_preference.json] [--steps 12] [--rounds 2]

Data made here (scripts/bench_packing.py's chats of Python's reference docs and its BPE with Llama 3's template):
SFT trains on the chats; the preference runs on pairs whose chosen answer is the chat's own and whose rejected
answer is another chat's. A Llama directory (4 layers, 256 wide, random weights) is every run's base; micro-batch 8
pairs (16 rows) against 16 chats, seq_len 256, fp32. The figure is summary.json's tokens_per_s (both answers'
rows count for a pair); a reference's forward passes are work that trains nothing, so they show as a lower rate.
The precomputed reference's one-off pass over the data before step 1 is reported apart (reference_computed_s).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_packing  # noqa: E402
import gpu_journeys  # noqa: E402

SIZE = {"hidden": 256, "layers": 4, "heads": 4, "kv": 2, "ffn": 704, "seq": 256}
RUNNERS = {
    "sft": ["--set", "batch.micro_batch=16", "--set", "batch.global_batch=16"],
    "dpo, frozen copy": ["--set", "objective.kind=dpo", "--set", "objective.reference=copy"],
    "dpo, precomputed": ["--set", "objective.kind=dpo", "--set", "objective.reference=precomputed"],
    "dpo + LoRA, adapters off": ["--set", "objective.kind=dpo", "--set", "lora.r=16"],
    "dpo + LoRA, frozen copy": ["--set", "objective.kind=dpo", "--set", "lora.r=16",
                                "--set", "objective.reference=copy"],
    "sft + LoRA": ["--set", "lora.r=16", "--set", "batch.micro_batch=16", "--set", "batch.global_batch=16"],
    "orpo (no reference)": ["--set", "objective.kind=orpo"],
}


def run(root: Path, name: str, base: Path, data: Path, steps: int) -> dict:
    out = root / name.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "").replace("+", "p")
    args = [bench_packing.bigtrain_command(), "train", "--num-gpus", "1", "--model", "hf", "--set",
            f"model.pretrained={base}", "--data", str(data), "--steps", str(steps), "--out", str(out), "--overwrite",
            "--peak-tflops", "1", "--set", "precision=fp32", "--set", f"data.seq_len={SIZE['seq']}",
            "--set", "batch.micro_batch=8", "--set", "batch.global_batch=8", "--set", "train.eval_interval=0",
            "--set", "train.eval_batches=0", "--set", "train.sample_tokens=0", "--set", "logging.progress_bar=false",
            "--set", "checkpoint.at_end=false", *RUNNERS[name]]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {"name": name, "tokens_per_s": summary["tokens_per_s"], "samples_per_s": summary["samples_per_s"],
            "step_s_median": summary["step_s_median"], "final_loss": summary["final_loss"],
            "reference_computed_s": summary.get("data", {}).get("reference_logps", {}).get("computed_s")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="docs/bench_preference.json")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    results: dict = {"started": time.strftime("%F %T"), "steps": args.steps, "size": SIZE, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        chats, tok = bench_packing.make_data(root, examples=600)
        base = gpu_journeys.make_base(root, tok, {**SIZE, "seq": SIZE["seq"]})
        pairs = bench_packing.make_pairs(chats, root / "pairs.jsonl")
        names = list(RUNNERS)
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                row = run(root, name, base, chats if name.startswith("sft") else pairs, args.steps)
                results["runs"].append(row)
                print(json.dumps(row), flush=True)
    by = {n: [x["tokens_per_s"] for x in results["runs"] if x["name"] == n] for n in RUNNERS}
    results["ratio_to_sft"] = {n: [a / b for a, b in zip(v, by["sft"])] for n, v in by.items()}
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    for name, ratios in results["ratio_to_sft"].items():
        print(f"{name}: tokens/s / SFT's = {', '.join(f'{r:.2f}' for r in ratios)}")


if __name__ == "__main__":
    main()
