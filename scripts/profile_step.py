"""Where a training step's time goes: torch.profiler over a few DeepSpeed steps, grouped by kind of op.

Run it like a job (2 ranks, the runner's environment); rank 0 writes the table:

    OMP_NUM_THREADS=1 GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736 \\
    PYTHONPATH=. deepspeed --num_gpus 2 scripts/profile_step.py --size mini --precision bf16 --zero 1 --out runs/profile

The model, data and DeepSpeed config are the benchmark's (bigtrain.bench), so the breakdown
explains the numbers in docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402

from bigtrain import models  # noqa: E402
from bigtrain.bench.baseline import same_rank_setup, synthetic_batches, to_device  # noqa: E402
from bigtrain.bench.cases import Case, Strategy, Workload  # noqa: E402
from bigtrain.bench.jobs import ds_config_for, job_description  # noqa: E402

# First matching pattern names the kind of an op (profiler names, lower-cased).
KINDS = (("matmul", ("addmm", "aten::mm", "bmm", "matmul", "linear", "onednn", "mkldnn")),
         ("attention", ("attention", "sdpa", "flash")),
         ("loss (log-softmax / cross-entropy)", ("log_softmax", "nll_loss", "cross_entropy")),
         ("optimizer", ("adam", "_foreach", "optimizer")),
         ("communication", ("gloo", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
                            "broadcast", "c10d")),
         ("copies / casts", ("aten::copy_", "aten::to", "_to_copy", "clone", "contiguous", "cat", "flatten")),
         ("embedding", ("embedding",)),
         ("elementwise / norms", ("gelu", "layer_norm", "add", "mul", "div", "tanh", "pow", "dropout", "fill",
                                  "zero_", "sum", "mean", "where", "sub", "exp", "sqrt")))


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, patterns in KINDS:
        if any(p in low for p in patterns):
            return kind
    return "other"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="mini")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--zero", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="profiled steps (after 2 warm-up steps)")
    p.add_argument("--shapes", action="store_true", help="also list the top ops by input shape")
    p.add_argument("--out", default="runs/profile")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    workload = Workload(f"gpt2-{args.size}", "gpt2", args.size, {}, seq_len=args.seq_len,
                        micro_batch=args.micro_batch, precision=args.precision)
    case = Case(workload, Strategy(zero=args.zero), "deepspeed", steps=args.steps)
    ds_config = ds_config_for(case, 2)
    ds_config["wall_clock_breakdown"] = False
    job = job_description(case, ds_config)

    same_rank_setup()
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    spec = models.build("gpt2", args.size, **job["spec_kwargs"])
    engine, *_ = deepspeed.initialize(model=spec.build(), config=ds_config)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    data = synthetic_batches(job, rank, world, args.micro_batch)

    def step() -> None:
        inputs, labels = spec.batch_to_inputs(next(data))
        loss = spec.loss(engine(to_device(inputs, engine.device, dtype)), labels.to(engine.device))
        engine.backward(loss)
        engine.step()

    for _ in range(2):
        step()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=args.shapes) as prof:
        for _ in range(args.steps):
            step()
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / args.steps
    if rank == 0:
        print(f"page faults per step on rank 0: {faults:.0f}", flush=True)
        write_breakdown(prof, args, Path(args.out))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


def write_breakdown(prof: torch.profiler.profile, args: argparse.Namespace, out: Path) -> None:
    """Self CPU time per kind of op (ms per step and share), plus the top 25 ops."""
    events = prof.key_averages()
    per_kind: dict[str, float] = defaultdict(float)
    for e in events:
        per_kind[kind_of(e.key)] += e.self_cpu_time_total / 1000.0 / args.steps
    total = sum(per_kind.values())
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"gpt2-{args.size} seq {args.seq_len} micro-batch {args.micro_batch} {args.precision} ZeRO-{args.zero}: "
             f"{total:.0f} ms of op self-time per step on rank 0", "", "| kind | ms/step | share |", "|---|---|---|"]
    lines += [f"| {k} | {v:.0f} | {100 * v / total:.1f}% |" for k, v in sorted(per_kind.items(), key=lambda kv: -kv[1])]
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:25]
    lines += ["", "| op | ms/step | calls/step |", "|---|---|---|"]
    lines += [f"| {e.key} | {e.self_cpu_time_total / 1000 / args.steps:.1f} | {e.count / args.steps:.0f} |" for e in top]
    if args.shapes:
        shaped = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)[:30]
        lines += ["", "| op | input shapes | ms/step | calls/step |", "|---|---|---|---|"]
        lines += [f"| {e.key} | {str(e.input_shapes)[:90]} | {e.self_cpu_time_total / 1000 / args.steps:.1f} | "
                  f"{e.count / args.steps:.0f} |" for e in shaped]
    text = "\n".join(lines)
    (out / f"profile_{args.size}_{args.precision}_z{args.zero}.md").write_text(text + "\n")
    (out / f"profile_{args.size}_{args.precision}_z{args.zero}.json").write_text(json.dumps(per_kind, indent=1))
    print(text, flush=True)


if __name__ == "__main__":
    sys.exit(main())
