"""Every byte one more token costs a rank during a training step, on this machine's CPU ranks: the Llama
shape of scripts/bench_parallel.py (4 layers x 256, MLP 704, vocabulary 512, fp32, ZeRO-1, micro-batch 1) at
parallel.sequence 1, 2, 4, tiled and not, with and without activation checkpointing, each at two sequence lengths.
Step 2 of each job runs under `bigtrain.estimate.live_bytes.LiveBytes` (every storage an op makes, labelled with its
module, pass, op and whether autograd saved it) and torch.profiler's memory events (the CPU allocator's own count);
the per-token cost is the difference of the two peaks over the difference of the lengths, by label.

    .venv/bin/python scripts/profile_alst.py --out docs/alst_profile.json [--lengths 4096,8192] [--sequences 1,2,4]
    .venv/bin/python scripts/profile_alst.py --markdown docs/alst_profile.json     # the tables of docs/parallelism.md

One launch per sequence size runs all of its jobs (this file again, as the ranks' script). Memory, not time:
other work on the machine changes neither count.
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
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_parallel  # noqa: E402  (the shape every ALST measurement uses)

SETUPS = {"plain": [], "tiled": ["--set", "activation_checkpointing.tiled_mlp=true"],
          "ckpt": ["--set", "activation_checkpointing.enabled=true"],
          "ckpt+tiled": ["--set", "activation_checkpointing.enabled=true",
                         "--set", "activation_checkpointing.tiled_mlp=true"],
          # every lever a CPU takes (the hidden states' offload moves nothing where host memory is the device's)
          "ckpt+tiled+chunked": ["--set", "activation_checkpointing.enabled=true",
                                 "--set", "activation_checkpointing.tiled_mlp=true", "--set", "train.loss_impl=chunked"]}
UNTILED = ["--set", "activation_checkpointing.tiled_mlp=false"]


def job_args(sequence: int, setup: str, length: int, extra: list[str]) -> list[str]:
    tiling = SETUPS[setup] if "tiled" in setup else [*SETUPS[setup], *UNTILED]
    return [*bench_parallel.LLAMA, "--set", f"data.seq_len={length}", "--set", f"parallel.sequence={sequence}",
            "--set", "batch.global_batch=1", "--set", "checkpoint.at_end=false", *tiling, *extra]


def worker(root: Path, plan: Path) -> None:
    """A rank's side: every job of the plan, each writing ROOT/NAME/rank{R}.json (its step's snapshot)."""
    from bigtrain.distributed.world import barrier, init_distributed, shutdown
    from bigtrain.estimate.token_profile import profile_job
    world = init_distributed()
    for job in json.loads(plan.read_text()):
        out = root / job["name"]
        snapshot = profile_job(["--out", str(out / "run"), *job["args"]], world, allocator=True)
        (out / f"rank{world.rank}.json").write_text(json.dumps(snapshot.to_json()))
        barrier()
    shutdown()


def launch(sequence: int, jobs: list[dict], root: Path) -> None:
    plan = root / f"plan_sp{sequence}.json"
    plan.write_text(json.dumps(jobs))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    cmd = [str(bench_parallel.BIN / "torchrun"), "--nproc_per_node", str(sequence), "--master_port",
           str(29500 + os.getpid() % 1000), __file__, "--worker", str(root), str(plan)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"sp{sequence} launch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")


def measure(sequences: list[int], lengths: list[int], setups: list[str], extra: list[str]) -> dict:
    from bigtrain.estimate.live_bytes import Snapshot, per_token
    from bigtrain.estimate.token_profile import row_of
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for sequence in sequences:
            jobs = [{"name": f"sp{sequence}_{setup}_{length}", "args": job_args(sequence, setup, length, extra)}
                    for setup in setups for length in lengths]
            started = time.time()
            launch(sequence, jobs, root)
            print(f"sp{sequence}: {len(jobs)} jobs in {time.time() - started:.0f} s", flush=True)
            for setup in setups:
                ranks = {length: [Snapshot.from_json(json.loads((root / f"sp{sequence}_{setup}_{length}" /
                                                                  f"rank{r}.json").read_text()))
                                  for r in range(sequence)] for length in lengths}
                short, long = lengths[0], lengths[-1]
                tokens = long - short
                peaks = {length: max(s.peak for s in ranks[length]) for length in lengths}
                allocator = {length: max(s.allocator_peak for s in ranks[length]) for length in lengths}
                # the rank whose allocator peaked highest at the longer length: its breakdown (every rank of a
                # group holds the same shapes; rank 0 also holds the step's loss)
                top = max(range(sequence), key=lambda r: ranks[long][r].allocator_peak)
                by_row = per_token(ranks[short][top], ranks[long][top], tokens, row_of)
                a, b = ranks[short][top].allocator_live, ranks[long][top].allocator_live
                kernel = {op: (b.get(op, 0) - a.get(op, 0)) / tokens for op in set(a) | set(b)}
                rows.append({"sequence": sequence, "setup": setup, "lengths": lengths, "peaks": peaks, "rank": top,
                             "rank_peaks": {n: [s.peak for s in ranks[n]] for n in lengths},
                             "rank_allocator_peaks": {n: [s.allocator_peak for s in ranks[n]] for n in lengths},
                             "allocator_peaks": allocator,
                             "bytes_per_token": (peaks[long] - peaks[short]) / tokens,
                             "allocator_bytes_per_token": (allocator[long] - allocator[short]) / tokens,
                             "rows": [[*k, v] for k, v in by_row.items() if abs(v) >= 0.5],
                             "allocator_rows": {op: v for op, v in sorted(kernel.items()) if abs(v) >= 0.5}})
                print(f"  {setup}: {rows[-1]['bytes_per_token']:.0f} B/token (allocator "
                      f"{rows[-1]['allocator_bytes_per_token']:.0f})", flush=True)
    return {"rows": rows}


# What the profile's labels are, for the table (module, op as LiveBytes names them)
WHAT = {("layers.*", "add"): "block output (the residual stream; kept: the next block's input)",
        ("embed_tokens", "embedding"): "embedding output (the first block's input)",
        ("layers.*.input_layernorm", "mul"): "RMSNorm: x * rstd and weight * x^",
        ("layers.*.post_attention_layernorm", "mul"): "RMSNorm: x * rstd and weight * x^",
        ("layers.*.self_attn", "add"): "q, k after RoPE",
        ("layers.*.self_attn.v_proj", "mm"): "v",
        ("layers.*.self_attn", "_scaled_dot_product_flash_attention_for_cpu"): "attention output, log-sum-exp",
        ("UlyssesSPAttentionHF", "_scaled_dot_product_flash_attention_for_cpu"): "attention output, log-sum-exp",
        ("UlyssesSPAttentionHF", "clone"): "q, k, v after Ulysses' all-to-all (contiguous)",
        ("UlyssesSPAttentionHF", "dim_zero_all_to_all"): "k or v as the all-to-all returns it",
        ("layers.*.mlp.gate_proj", "mm"): "MLP gate", ("layers.*.mlp.up_proj", "mm"): "MLP up",
        ("layers.*.mlp.act_fn", "silu"): "MLP SiLU(gate)", ("layers.*.mlp", "mul"): "MLP SiLU(gate) * up",
        ("layers.*.mlp", "zeros_like"): "TiledMLP's input gradient", ("rotary_emb", "mul"): "RoPE cos, sin",
        ("(outside modules)", "_log_softmax"): "log-probabilities",
        ("layers.*.input_layernorm", "empty"): "lean RMSNorm's output", ("layers.*.post_attention_layernorm", "empty"):
        "lean RMSNorm's output"}
# What a row made in backward and alive at the peak is
IN_BACKWARD = {("layers.*.mlp", "mul"): "gradients of SiLU(gate) and of up", ("layers.*.mlp", "mm"): "gradient of the "
               "MLP product", ("model", "add"): "gradient of the residual stream", ("layers.*", "add"): "gradient of "
               "the residual stream", ("layers.*.mlp", "zeros_like"): "TiledMLP's input gradient",
               ("layers.*.post_attention_layernorm", "mul"): "RMSNorm's backward",
               ("model", "empty_like"): "lean RMSNorm's input gradient",
               ("layers.*.post_attention_layernorm", "add"): "RMSNorm's backward",
               ("layers.*.post_attention_layernorm", "div"): "RMSNorm's backward",
               ("layers.*.post_attention_layernorm", "pow"): "RMSNorm's backward"}


def render(result: dict, setups: tuple[str, ...] = ("plain", "ckpt+tiled")) -> str:
    """docs/parallelism.md's tables from a profile: the slopes of every setup, and what makes them up."""
    rows = {(r["sequence"], r["setup"]): r for r in result["rows"]}
    sequences = sorted({r["sequence"] for r in result["rows"]})
    names = list(dict.fromkeys(r["setup"] for r in result["rows"]))
    lines = ["| setup | " + " | ".join(f"SP{u}" for u in sequences) + " | SP2 / SP1 | SP4 / SP1 | allocator's count |",
             "|---|" + "---|" * (len(sequences) + 3)]
    for name in names:
        slopes = [rows[u, name]["bytes_per_token"] for u in sequences]
        alloc = " / ".join(f"{rows[u, name]['allocator_bytes_per_token']:.0f}" for u in sequences)
        ratios = [f"{rows[u, name]['bytes_per_token'] / slopes[0]:.3f}" if (u, name) in rows else "-" for u in (2, 4)]
        lines.append(f"| {name} | " + " | ".join(f"{v:.0f}" for v in slopes) + f" | {' | '.join(ratios)} | {alloc} |")
    for name in setups:
        lines += ["", f"**{name}**, bytes per token of the sequence, one rank (each row read at each length's peak):",
                  "", "| module | op | kept | what | " + " | ".join(f"SP{u}" for u in sequences) + " |",
                  "|---|---|---|---|" + "---|" * len(sequences)]
        table: dict[tuple, dict[int, float]] = {}
        for u in sequences:
            for where, op, kept, value in rows[u, name]["rows"]:
                table.setdefault((where, op, kept), {})[u] = value
        total = rows[sequences[0], name]["bytes_per_token"]
        for (where, op, kept), values in sorted(table.items(), key=lambda kv: -abs(kv[1].get(sequences[0], 0))):
            if max(abs(v) for v in values.values()) < 0.01 * total:
                continue
            what = (WHAT if kept == "saved" else IN_BACKWARD).get((where, op), "")
            lines.append(f"| {where} | {op} | {kept} | {what} | "
                         + " | ".join(f"{values.get(u, 0):.0f}" for u in sequences) + " |")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--markdown":  # the tables of a profile already measured
        print(render(json.loads(Path(sys.argv[2]).read_text())))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), Path(sys.argv[3]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="docs/alst_profile.json")
    p.add_argument("--lengths", default="4096,8192")
    p.add_argument("--sequences", default="1,2,4")
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--set", action="append", default=[], help="another run-config override for every job")
    p.add_argument("--merge", help="a previous profile: its rows not measured now are kept, under its own run's "
                                   "fields (recorded in 'merged_from')")
    args = p.parse_args()
    extra = [a for s in args.set for a in ("--set", s)]
    started = time.strftime("%F %T")
    result = measure([int(s) for s in args.sequences.split(",")], [int(n) for n in args.lengths.split(",")],
                     args.setups.split(","), extra)
    result.update(machine=os.uname().nodename, cores=os.cpu_count(), started=started,
                  finished=time.strftime("%F %T"), command=" ".join(["scripts/profile_alst.py", *sys.argv[1:]]))
    if args.merge:
        old = json.loads(Path(args.merge).read_text())
        ran = {(r["sequence"], r["setup"]) for r in result["rows"]}
        order = {name: i for i, name in enumerate(SETUPS)}
        result["rows"] = sorted([r for r in old["rows"] if (r["sequence"], r["setup"]) not in ran] + result["rows"],
                                key=lambda r: (r["sequence"], order.get(r["setup"], len(order))))
        result["merged_from"] = {k: v for k, v in old.items() if k not in ("rows", "merged_from")}
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
