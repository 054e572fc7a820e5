"""Measure what ALST's tiled MLP buys (issue 31), on this machine's CPU ranks, with the Llama shape of
scripts/bench_parallel.py (4 layers x 256, MLP 704, fp32, ZeRO-1, micro-batch 1, 2 steps per probe):

1. per_token: the peak RSS a rank adds per token of sequence, tiled and not, at parallel.sequence 1 and 2 (the
   slope between two lengths, from the largest per-rank peak of each job);
2. seq: the longest sequence under a per-rank cap at parallel.sequence 1, 2, 4, tiled and not (bisected over
   multiples of 256, as bench_parallel.py does).

    .venv/bin/python scripts/bench_alst.py --out docs/bench_alst.json [--cap-gib 1.6] [--only per_token|seq]

Results are written after every measurement, so an interrupted run keeps what it measured.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_parallel  # noqa: E402  (its job runner and bisection, with the same model)

TILED = {True: ["--set", "activation_checkpointing.tiled_mlp=true"],
         False: ["--set", "activation_checkpointing.tiled_mlp=false"]}


def peak(result: dict | None) -> int | None:
    return max(r["peak_rss_bytes"] for r in result["peak_memory_per_rank"]) if result else None


def per_token(sequence: int, tiled: bool, lengths: tuple[int, int], root: Path) -> dict:
    peaks = []
    for length in lengths:
        result = bench_parallel.job(sequence, ["--set", f"data.seq_len={length}", "--set",
                                               f"parallel.sequence={sequence}", "--set", "batch.global_batch=1",
                                               *TILED[tiled]], root / f"pt_sp{sequence}_{tiled}_{length}")
        peaks.append(peak(result))
    slope = (peaks[1] - peaks[0]) / (lengths[1] - lengths[0]) if None not in peaks else None
    print(f"per token sp{sequence} tiled={tiled}: {peaks} -> {slope and slope / 1024:.2f} KiB/token", flush=True)
    return {"sequence": sequence, "tiled": tiled, "lengths": lengths, "peaks": peaks, "bytes_per_token": slope}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="docs/bench_alst.json")
    p.add_argument("--only", choices=["per_token", "seq"])
    p.add_argument("--cap-gib", type=float, default=1.6)
    p.add_argument("--sequences", default="1,2,4")
    args = p.parse_args()
    results: dict = {"machine": os.uname().nodename, "cores": os.cpu_count(), "started": time.strftime("%F %T"),
                     "command": " ".join(sys.argv), "per_token": [], "seq": []}
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.only in (None, "per_token"):
            for sequence in (1, 2):
                for tiled in (False, True):
                    results["per_token"].append(per_token(sequence, tiled, (2048, 4096), root))
                    out.write_text(json.dumps(results, indent=2))
        if args.only in (None, "seq"):
            cap = int(args.cap_gib * 2**30)
            results["cap_bytes"] = cap
            for sequence in (int(s) for s in args.sequences.split(",")):
                for tiled in (True, False):
                    bench_parallel.LLAMA = [*BASE, *TILED[tiled]]
                    row = bench_parallel.longest_sequence(sequence, cap, root / f"{sequence}_{tiled}")
                    results["seq"].append({**row, "tiled": tiled})
                    out.write_text(json.dumps(results, indent=2))
    results["finished"] = time.strftime("%F %T")
    out.write_text(json.dumps(results, indent=2))


BASE = list(bench_parallel.LLAMA)

if __name__ == "__main__":
    main()
