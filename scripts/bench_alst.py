"""What ALST's levers buy (the tiled MLP and the chunked loss), on this machine's CPU ranks, with the Llama shape of
scripts/bench_parallel.py (4 layers x 256, MLP 704, vocabulary 512, fp32, ZeRO-1, micro-batch 1), activation
checkpointing on, tiled MLP and chunked loss ("tiled") and neither, at parallel.sequence 1, 2, 4:

1. per_token: what one more token costs a rank: the slope between two lengths of the rank's peak of live tensor
   bytes (the tensors alive before step 2, model states and buffers, plus step 2's peak counted tensor by tensor:
   bigtrain.estimate.live_bytes; RSS, which keeps freed pages, is not used);
2. seq: the longest sequence (a multiple of 256) whose step 2 keeps every rank's peak under a cap, searched inside
   one launch per case from the length the per-token line predicts (the ranks agree on each probe's largest peak).

Memory, not time, is the measure: the 2 cores are shared with other work, which changes no count; the probes'
seconds are printed as noisy. `--code DIR` runs the jobs with another checkout's bigtrain (to measure an older
commit in the same run: copy bigtrain/estimate/live_bytes.py and token_profile.py into it first).

    .venv/bin/python scripts/bench_alst.py --out docs/bench_alst.json [--cap-mib 480] [--only per_token|seq]

Results are written after every case, so an interrupted run keeps what it measured.
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

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))
import bench_parallel  # noqa: E402  (the shape every ALST measurement uses)

# "tiled" is every lever ALST pulls on a rank that a CPU can show: the tiled MLP and the chunked loss (which `auto`
# leaves off on a CPU); "not" is checkpointing alone.
LEVERS = {True: ["--set", "activation_checkpointing.enabled=true", "--set", "activation_checkpointing.tiled_mlp=true",
                 "--set", "train.loss_impl=chunked"],
          False: ["--set", "activation_checkpointing.enabled=true", "--set", "activation_checkpointing.tiled_mlp=false",
                  "--set", "train.loss_impl=plain"]}


def job_args(sequence: int, tiled: bool, length: int) -> list[str]:
    return [*bench_parallel.LLAMA, "--set", f"data.seq_len={length}", "--set", f"parallel.sequence={sequence}",
            "--set", "batch.global_batch=1", "--set", "checkpoint.at_end=false", *LEVERS[tiled]]


# -- a rank's side ----------------------------------------------------------------------------------------------
def rank_peak(args: list[str], out: Path, world) -> tuple[int, float]:
    """(the largest rank peak of the group's step 2, seconds the job took)."""
    import torch

    from bigtrain.estimate.token_profile import profile_job
    started = time.time()
    snapshot = profile_job(["--out", str(out), *args], world)
    peak = torch.tensor([float(snapshot.resident + snapshot.peak)], dtype=torch.float64)
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    return int(peak.item()), time.time() - started


def worker(root: Path, plan: Path) -> None:
    from bigtrain.distributed.world import init_distributed, shutdown
    world = init_distributed()
    case = json.loads(plan.read_text())
    if case["kind"] == "per_token":
        result = {n: rank_peak(job_args(case["sequence"], case["tiled"], n), root / f"run_{n}", world)
                  for n in case["lengths"]}
    else:
        result = bisect(case, root, world)
    if world.rank == 0:
        (root / "result.json").write_text(json.dumps(result))
    shutdown()


def bisect(case: dict, root: Path, world) -> dict:
    """The longest multiple of 256 under the cap: from `start` (the per-token line's prediction), up or down by a
    doubling step until the answer changes, then halving down to 256."""
    probes: list[dict] = []

    def fits(length: int) -> bool:
        peak, seconds = rank_peak(job_args(case["sequence"], case["tiled"], length), root / f"run_{length}", world)
        probes.append({"seq_len": length, "peak_bytes_per_rank": peak, "fits": peak <= case["cap"],
                       "seconds_noisy": round(seconds, 1)})
        return peak <= case["cap"]

    length, step = max(256, case["start"] // 256 * 256), 256
    low, high = (length, None) if fits(length) else (None, length)
    while low is None or high is None:  # gallop to the other side
        length = length + step if high is None else max(256, length - step)
        step *= 2
        if fits(length):
            low = length
        else:
            high = length
        if low is None and length == 256:
            return {"longest_seq_len": 0, "probes": probes}
    while high - low > 256:
        middle = (low + high) // 512 * 256
        if fits(middle):
            low = middle
        else:
            high = middle
    return {"longest_seq_len": low, "probes": probes}


# -- the driver -------------------------------------------------------------------------------------------------
def launch(case: dict, ranks: int, code: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "plan.json").write_text(json.dumps(case))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(code)}
        cmd = [str(bench_parallel.BIN / "torchrun"), "--nproc_per_node", str(ranks), "--master_port",
               str(29500 + os.getpid() % 1000), __file__, "--worker", str(root), str(root / "plan.json")]
        proc = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True, timeout=6 * 3600)
        if proc.returncode != 0:
            raise SystemExit(f"{case} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
        return json.loads((root / "result.json").read_text())


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), Path(sys.argv[3]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="docs/bench_alst.json")
    p.add_argument("--only", choices=["per_token", "seq"])
    p.add_argument("--cap-mib", type=float, default=480.0, help="the rank's peak of live tensor bytes a length "
                                                                 "must stay under (seq)")
    p.add_argument("--lengths", default="4096,8192")
    p.add_argument("--sequences", default="1,2,4")
    p.add_argument("--levers", choices=["both", "tiled", "untiled"], default="both",
                   help="which cases to run (a change to the tiled levers alone: re-measure --levers tiled and "
                        "--merge into the file the untiled cases came from)")
    p.add_argument("--merge", help="a previous result file: its cases not run now are kept, under its own run's "
                                   "fields (recorded in 'merged_from')")
    p.add_argument("--code", default=str(SCRIPTS.parent), help="the checkout whose bigtrain the jobs run")
    args = p.parse_args()
    code = Path(args.code).resolve()
    commit = subprocess.run(["git", "-C", str(code), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "?"
    results: dict = {"machine": os.uname().nodename, "cores": os.cpu_count(), "started": time.strftime("%F %T"),
                     "command": " ".join(["scripts/bench_alst.py", *sys.argv[1:]]), "code": str(code),
                     "commit": commit, "per_token": [], "seq": []}
    out = Path(args.out)
    lengths = [int(n) for n in args.lengths.split(",")]
    for sequence in (int(s) for s in args.sequences.split(",")):
        for tiled in {"both": (False, True), "tiled": (True,), "untiled": (False,)}[args.levers]:
            start = 1024 * sequence
            if args.only in (None, "per_token"):
                measured = launch({"kind": "per_token", "sequence": sequence, "tiled": tiled, "lengths": lengths},
                                  sequence, code)
                peaks = [measured[str(n)][0] for n in lengths]
                slope = (peaks[-1] - peaks[0]) / (lengths[-1] - lengths[0])
                results["per_token"].append({"sequence": sequence, "tiled": tiled, "lengths": lengths,
                                             "peaks": peaks, "bytes_per_token": slope,
                                             "seconds_noisy": [round(measured[str(n)][1], 1) for n in lengths]})
                print(f"sp{sequence} tiled={tiled}: {slope:.0f} B/token", flush=True)
                start = int(lengths[-1] + (args.cap_mib * 2**20 - peaks[-1]) / slope)  # the line's answer
            if args.only in (None, "seq"):
                results["cap_bytes"] = cap = int(args.cap_mib * 2**20)
                row = launch({"kind": "seq", "sequence": sequence, "tiled": tiled, "cap": cap, "start": start},
                             sequence, code)
                results["seq"].append({"sequence": sequence, "tiled": tiled, **row})
                print(f"sp{sequence} tiled={tiled}: longest {row['longest_seq_len']}", flush=True)
            out.write_text(json.dumps(results, indent=1))
    results["finished"] = time.strftime("%F %T")
    if args.merge:
        results = merged(json.loads(Path(args.merge).read_text()), results)
    out.write_text(json.dumps(results, indent=1))


def merged(old: dict, new: dict) -> dict:
    """`new`, plus `old`'s cases that `new` did not run; `old`'s run fields kept under 'merged_from'."""
    ran = {(r["sequence"], r["tiled"]) for kind in ("per_token", "seq") for r in new[kind]}
    for kind in ("per_token", "seq"):
        kept = [r for r in old[kind] if (r["sequence"], r["tiled"]) not in ran]
        new[kind] = sorted(kept + new[kind], key=lambda r: (r["sequence"], r["tiled"]))
    new["merged_from"] = {k: v for k, v in old.items() if k not in ("per_token", "seq", "merged_from")}
    return new


if __name__ == "__main__":
    main()
