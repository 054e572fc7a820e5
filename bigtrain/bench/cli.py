"""`bigtrain bench`: run a sweep (or the capacity search) and write the tables and plots.

    bigtrain bench --short                     # CI: tiny sizes, ~1 min, checks the numbers are sane
    bigtrain bench                             # full sweep (~45 min): docs/benchmarks.md + docs/img/*.png
    bigtrain bench --capacity                  # largest GPT-2 per strategy (~30 min): its own section
    bigtrain bench --gpu                       # GPT-2 small/medium, ZeRO 1-3, baselines, levers; one rank per GPU
    bigtrain bench --gpu --dry-run             # the same plan on the tiniest GPT-2 on this host (no GPU), 3 steps each
    bigtrain bench --trl                       # bigtrain against TRL's SFT, DPO and GRPO trainers, one process each
    bigtrain bench --from-json docs/benchmarks.json   # rewrite the page from saved results
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bigtrain.bench.jobs import REPO

DOCS = REPO / "docs"


def _log(line: str) -> None:
    print(line, flush=True)


def publish(report: dict, page: Path, img_dir: Path) -> list[Path]:
    """Tables into the page's sweep (or gpu) section, plots into img_dir; returns the images."""
    from bigtrain.bench.doc import gpu_section, sweep_section, update_page
    from bigtrain.bench.plots import write_plots
    if report["meta"]["mode"] in ("trl", "trl-dry"):
        from bigtrain.bench.trl_report import section
        update_page(page, "trl", section(report))
        return []
    if report["meta"]["mode"] in ("gpu", "gpu-dry"):  # its own section; the CPU sweep's plots stay
        update_page(page, "gpu", gpu_section(report["rows"], report["ratios"], report["meta"]))
        return []
    images = write_plots(report["rows"], report["ratios"], img_dir)
    update_page(page, "sweep", sweep_section(report["rows"], report["ratios"], report["meta"], images, page))
    return images


def cmd_bench(args: argparse.Namespace) -> int:
    if args.from_json:
        from bigtrain.bench.rows import ratios
        report = json.loads(Path(args.from_json).read_text())
        if report["meta"]["mode"] not in ("trl", "trl-dry"):
            report["ratios"] = ratios(report["rows"])  # with today's statistics
        publish(report, Path(args.page or DOCS / "benchmarks.md"), Path(args.img_dir or DOCS / "img"))
        return 0
    workdir = Path(args.workdir)
    from bigtrain.metrics.logs import attach_log_file, route_library_logs
    route_library_logs()  # DeepSpeed's lines from this process (its accelerator, the configs it checks) are
    attach_log_file(workdir, 0, "bench.log")  # the log's, as in a run; the jobs' own logs are beside it
    if args.capacity:
        return _capacity(args, workdir)
    if args.trl:
        return _trl(args, workdir)
    if args.dry_run and not args.gpu:
        print("bigtrain bench: --dry-run goes with --gpu or --trl (it runs their plan on tiny models, a few steps "
              "each)", file=sys.stderr)
        return 2
    from bigtrain.bench.sweep import full_plan, gpu_plan, run_plan, save_results, short_plan
    if args.gpu:
        import torch
        repeats = {"repeats": args.repeats} if args.repeats else {}
        plan = gpu_plan(torch.cuda.device_count() if torch.cuda.is_available() else 0, dry=args.dry_run, **repeats)
    else:
        plan = short_plan() if args.short else full_plan(**({"repeats": args.repeats} if args.repeats else {}))
    if args.only:
        import re
        plan.cases = [c for c in plan.cases if re.search(args.only, c.name)]
        if not plan.cases:
            print(f"bigtrain bench: --only {args.only!r} matches no case of the {plan.mode} plan", file=sys.stderr)
            return 2
    _log(f"bigtrain bench --{plan.mode}: {len(plan.cases)} jobs (+ the peak measurement), at most "
         f"{args.max_minutes:.0f} min; logs under {workdir}")
    report = run_plan(plan, workdir, args.max_minutes, log=_log)
    default_out = workdir if args.short or args.dry_run else DOCS  # CI never rewrites the committed page
    page = Path(args.page or default_out / "benchmarks.md")
    save_results(report, page.with_name(page.stem + ("_gpu" if args.gpu else "") + ".json"))
    images = publish(report, page, Path(args.img_dir or default_out / "img"))
    _log(f"wrote {page} and {len(images)} plots")
    for problem in report["problems"]:
        print(f"bigtrain bench: {problem}", file=sys.stderr)
    return 1 if report["problems"] else 0


def _trl(args: argparse.Namespace, workdir: Path) -> int:
    from bigtrain.bench.sweep import save_results
    from bigtrain.bench.trl_bench import run_trl_plan
    from bigtrain.bench.trl_cases import plan
    cases = plan(args.repeats or 3, args.only, dry=args.dry_run)
    if not cases:
        print(f"bigtrain bench: --only {args.only!r} matches none of sft, dpo, grpo", file=sys.stderr)
        return 2
    _log(f"bigtrain bench --trl: {len(cases)} jobs, at most {args.max_minutes:.0f} min; logs under {workdir}")
    report = run_trl_plan(cases, workdir, args.max_minutes, log=_log, dry=args.dry_run)
    report["meta"]["command"] = "bigtrain bench --trl" + (" --dry-run" if args.dry_run else "") + (
        f" --repeats {args.repeats}" if args.repeats else "") + (f" --only '{args.only}'" if args.only else "")
    page = Path(args.page or (workdir if args.dry_run else DOCS) / "benchmarks.md")
    save_results(report, page.with_name(page.stem + "_trl.json"))
    publish(report, page, Path(args.img_dir or page.parent / "img"))
    failed = [r["case"] for r in report["results"] if not r["ok"]]
    _log(f"wrote the trl section of {page}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def _capacity(args: argparse.Namespace, workdir: Path) -> int:
    from bigtrain.bench.capacity import CapacityPlan, default_budget, search_capacity
    from bigtrain.bench.doc import capacity_section, update_page
    from bigtrain.bench.hostenv import job_env
    from bigtrain.bench.sweep import save_results
    precision = args.capacity_precision
    if precision is None:  # bf16 where this host multiplies it natively: in software it is many times slower
        from bigtrain.distributed.device import bf16_not_native
        why = bf16_not_native("cpu")
        precision = "fp32" if why else "bf16"
        if why:
            _log(f"capacity search in fp32: {why} (--capacity-precision bf16 to insist)")
    plan = CapacityPlan(budget_bytes=default_budget(args.budget_gib), precision=precision)
    _log(f"capacity search: budget {plan.budget_bytes / 2**30:.1f} GiB, {plan.precision}, up to "
         f"{plan.max_probes} probes per strategy")
    result = search_capacity(plan, workdir, job_env(2), log=_log)
    page = Path(args.page or DOCS / "benchmarks.md")
    save_results(result, page.with_name("capacity.json"))
    update_page(page, "capacity", capacity_section(result))
    _log(f"wrote the capacity section of {page}; ratio {result['ratio']}")
    return 0 if result["ratio"] else 1


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark bigtrain against hand-written DeepSpeed and DDP loops",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--short", action="store_true", help="tiny sizes for CI; writes under --workdir")
    mode.add_argument("--full", action="store_true", help="the full sweep (the default)")
    mode.add_argument("--capacity", action="store_true", help="largest GPT-2 shape per ZeRO strategy")
    mode.add_argument("--gpu", action="store_true", help="GPT-2 small and medium on the GPUs, ZeRO-1/2 "
                                                         "against hand-written DeepSpeed: the page's gpu section")
    mode.add_argument("--trl", action="store_true", help="bigtrain against TRL's SFTTrainer, DPOTrainer and "
                                                         "GRPOTrainer on one model, data and settings, one process "
                                                         "each: the page's trl section")
    mode.add_argument("--from-json", metavar="FILE", help="rewrite the page and plots from saved results")
    p.add_argument("--dry-run", action="store_true", help="with --gpu: every case of the GPU plan (but the "
                   "CUDA-only ones) on the tiniest GPT-2 for 3 steps on this host; with --trl: one pair per objective "
                   "on a 2 x 64 Llama, 3 steps each; written under --workdir")
    p.add_argument("--only", metavar="REGEX", default=None, help="run only the cases whose name matches REGEX, "
                   "e.g. 'gpt2-small' or 'z1 (bigtrain|nanogpt)$' (with --trl: the objectives, e.g. 'grpo')")
    p.add_argument("--page", default=None, help="markdown page to update (default docs/benchmarks.md; "
                                                "--short: WORKDIR/benchmarks.md)")
    p.add_argument("--img-dir", default=None, help="where the PNGs go (default next to the page, in img/)")
    p.add_argument("--workdir", default="runs/bench", help="job outputs and logs")
    p.add_argument("--repeats", type=int, default=None,
                   help="bigtrain/DeepSpeed pairs per ZeRO stage (default: 6 for the CPU sweep, 1 with --gpu; --trl: "
                   "bigtrain/TRL pairs per objective, default 3)")
    p.add_argument("--max-minutes", type=float, default=120.0,
                   help="skip the remaining jobs after this long (a safety valve: --full takes ~45 min on 2 cores)")
    p.add_argument("--budget-gib", type=float, default=None,
                   help="capacity: memory budget of the whole job (default: what is free now, less 1.5 GiB)")
    p.add_argument("--capacity-precision", choices=("bf16", "fp32"), default=None,
                   help="capacity: precision (default bf16 where the CPU has native bf16, else fp32)")
    p.set_defaults(func=cmd_bench)
