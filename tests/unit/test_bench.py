"""`bigtrain bench`: the pieces (timers, cases, rows, page sections, capacity search, rank
tuning); the sweeps end to end through the real launcher are tests/dist/test_bench_runs.py."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch import REPO
from messages import naming

from bigtrain.bench.capacity import search_depth
from bigtrain.bench.cases import Case, Strategy, Workload
from bigtrain.bench.doc import replace_section
from bigtrain.bench.rows import check_rows, make_row, ratios
from bigtrain.bench.table import ratio_table
from bigtrain.bench.timers import step_split

DS_LOG = """[Rank 0] time (ms) | fwd_microstep: 10.00 | bwd_microstep: 20.00 | step_microstep: 5.00
[Rank 0] time (ms) | fwd: 100.00 | bwd: 200.00 | bwd_inner: 180.00 | bwd_allreduce: 20.00 | step: 50.00
[Rank 0] time (ms) | fwd: 90.00 | bwd: 190.00 | bwd_inner: 170.00 | bwd_allreduce: 20.00 | step: 40.00
[Rank 0] time (ms) | fwd: 11.50 | bwd: 21.00 | bwd_inner: 19.00 | bwd_allreduce: 2.00 | step: 4.00
[Rank 0] time (ms) | fwd: 12.50 | bwd: 23.00 | bwd_inner: 20.00 | bwd_allreduce: 3.00 | step: 6.00
[Rank 0] time (ms) | fwd: 13.50 | bwd: 25.00 | bwd_inner: 21.00 | bwd_allreduce: 4.00 | step: 8.00
"""
PEAKS = {"bf16": 0.05, "fp32": 0.1}
TINY = Workload("t", "gpt2", "custom", {"n_layer": 2, "n_embd": 64, "n_head": 2}, seq_len=64, vocab_size=512,
                micro_batch=2)


def test_step_split_takes_medians_of_global_timers_after_warmup():
    split = step_split(DS_LOG, warmup=2)
    assert split == {"forward": 12.5, "backward": 23.0, "step": 6.0, "allreduce": 3.0}
    assert step_split("no timers here") == {}


def test_case_overrides_make_a_valid_run_config_and_the_same_ds_config_for_every_runner():
    from bigtrain.bench.jobs import ds_config_for, job_description
    from bigtrain.config.load import load_run_config
    case = Case(TINY, Strategy(zero=3, offload="all", checkpointing=True), "bigtrain", steps=5)
    run = load_run_config(None, case.run_overrides())
    assert (run.zero.stage, run.offload.param, run.activation_checkpointing.enabled) == (3, "cpu", True)
    assert (run.train.steps, run.train.eval_batches, run.data.seq_len, run.model.overrides["n_layer"]) == (5, 0, 64, 2)
    ds = ds_config_for(case, 2)
    baseline = ds_config_for(Case(TINY, case.strategy, "deepspeed", steps=5), 2)
    assert ds == baseline and ds["wall_clock_breakdown"] is True and "csv_monitor" not in ds
    assert ds["train_batch_size"] == 4 and ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    job = job_description(case, ds)
    assert job["spec_kwargs"] == {"vocab_size": 512, "n_positions": 1024, "seq_len": 64, "n_layer": 2, "n_embd": 64,
                                  "n_head": 2, "vocab_multiple": 1}  # stated: bigtrain pads by default on GPUs
    assert Strategy(1, pipeline=2).label == "pp2 z1" and case.strategy.label == "z3 off-opt+param ac"


def test_strategy_rejects_combinations_deepspeed_cannot_run():
    with pytest.raises(ValueError, match=r"offload.param=cpu needs stage 3 \(got stage 1\)"):
        Strategy(zero=1, offload="all")
    with pytest.raises(ValueError, match="DeepSpeed pipelines support ZeRO 0-1 only"):
        Strategy(zero=2, pipeline=2)


def _result(runner, sps, strategy="z1", **kw):
    base = {"case": f"t {strategy} {runner}", "runner": runner, "workload": "t", "strategy": strategy,
            "group": "ratio", "precision": "bf16", "ok": True, "world_size": 2, "samples_per_s": sps,
            "step_s_median": 4 / sps, "flops_per_sample": 1e9, "tokens_per_sample": 64, "global_batch": 4,
            "num_params": 1000, "model_state_bytes_per_rank": [10, 12], "peak_rss_per_rank": [100, 90],
            "losses": [6.0, 5.5], "split_ms": {}}
    return {**base, **kw}


def test_rows_compute_mfu_against_both_peaks_and_ratios_from_medians():
    rows = [make_row(_result("bigtrain", s), PEAKS) for s in (10.0, 12.0, 11.0)]
    rows += [make_row(_result("deepspeed", s), PEAKS) for s in (10.0, 11.5)]
    rows.append(make_row(_result("ddp", 8.0), PEAKS))
    row = rows[0]
    assert row["tflops"] == pytest.approx(1e9 * 10 / 1e12)
    assert row["mfu_bf16"] == pytest.approx(0.01 / (0.05 * 2)) and row["mfu"] == row["mfu_bf16"]
    assert row["mfu_fp32"] == pytest.approx(0.01 / (0.1 * 2))
    assert (row["model_state_bytes"], row["peak_rss_bytes"], row["tokens_per_s"]) == (12, 100, 640.0)
    (rec,) = ratios(rows)
    assert rec["ratio_of_medians"] == pytest.approx(11.0 / 10.75) and rec["vs_ddp"] == pytest.approx(11.0 / 8.0)
    # k-th job against k-th job (the third bigtrain job has no partner), then the median
    assert rec["pair_ratios"] == pytest.approx([1.0, 12.0 / 11.5])
    assert rec["ratio"] == pytest.approx((1.0 + 12.0 / 11.5) / 2)
    assert check_rows(rows, PEAKS) == []


def test_loop_overhead_is_the_step_time_outside_deepspeeds_timed_phases():
    split = {"forward": 100.0, "backward": 250.0, "step": 40.0}
    rows = [make_row(_result("bigtrain", 10.0, step_s_median=0.4, split_ms=split), PEAKS),
            make_row(_result("bigtrain", 10.0, step_s_median=0.394, split_ms=split), PEAKS),
            make_row(_result("deepspeed", 10.0, step_s_median=0.392, split_ms=split), PEAKS),
            make_row(_result("ddp", 8.0), PEAKS)]  # no DeepSpeed timers: no loop figure
    assert rows[0]["loop_ms"] == pytest.approx(10.0) and rows[3]["loop_ms"] is None
    (rec,) = ratios(rows)
    assert rec["loop_ms_bigtrain"] == pytest.approx(7.0) and rec["loop_ms_deepspeed"] == pytest.approx(2.0)
    assert "| 7.0 vs 2.0 |" in ratio_table([rec]) and "| 1.000 |" in ratio_table([rec])


def test_check_rows_names_every_insane_number():
    rows = [make_row(_result("bigtrain", 1e6), PEAKS),  # 1e15 FLOP/s: MFU far above 1
            make_row(_result("deepspeed", 2.0, losses=[float("nan")]), PEAKS),
            make_row(_result("ddp", 2.0, num_params=999), PEAKS),
            make_row({**_result("bigtrain", 1.0, strategy="z2"), "ok": False, "error": "boom"}, PEAKS)]
    problems = check_rows(rows, {"bf16": 0.05, "fp32": float("nan")})
    assert naming(problems, "fp32 peak", "nan"), problems
    assert naming(problems, "t z1 bigtrain: ", "MFU 10000.000", "bf16 peak", "(0, 1]"), problems
    assert naming(problems, "t z1 deepspeed: ", "final loss nan"), problems
    assert naming(problems, "t z2 bigtrain: ", "(boom)"), problems
    assert naming(problems, "t: ", "sizes", "[999, 1000]"), problems


def test_settings_runs_set_their_environment_and_compare_with_the_defaults(tmp_path, monkeypatch):
    from bigtrain.bench import jobs
    from bigtrain.bench.sweep import settings_cases
    from bigtrain.bench.table import settings_table
    cases = settings_cases(TINY, Strategy(1))
    assert [c.setting for c in cases][0] == "defaults" and cases[-1].setting == "defaults, again"
    assert len({c.slug for c in cases}) == len(cases) and all("," not in c.slug for c in cases)
    seen = {}
    monkeypatch.setattr(jobs, "_run", lambda cmd, env, timeout, log: (seen.update(env) or 1, "", 0.0))
    result = jobs.run_case(cases[1], tmp_path, jobs.Launch({"OMP_NUM_THREADS": "1"}))
    assert seen["BIGTRAIN_BIND_CORES"] == "0" and seen["OMP_NUM_THREADS"] == "1"
    assert result["setting"] == "no core binding" and not result["ok"]
    rows = [make_row(_result("bigtrain", sps, group="settings", setting=name), PEAKS)
            for sps, name in ((10.0, "defaults"), (8.0, "no core binding"), (12.0, "defaults, again"))]
    table = settings_table(rows)
    assert "| no core binding |" in table and "| 0.727 |" in table  # 8 against the mean of 10 and 12


def test_replace_section_rewrites_only_between_its_markers():
    page = "# B\n\nprose\n\n<!-- bench:sweep begin -->\nold\n<!-- bench:sweep end -->\n\nmore prose\n"
    new = replace_section(page, "sweep", "new table")
    assert new == "# B\n\nprose\n\n<!-- bench:sweep begin -->\nnew table\n<!-- bench:sweep end -->\n\nmore prose\n"
    added = replace_section(new, "capacity", "cap")
    assert added.endswith("<!-- bench:capacity begin -->\ncap\n<!-- bench:capacity end -->\n") and "new table" in added


def test_gpu_plan_pairs_gpt2_small_and_medium_with_deepspeed_one_rank_per_gpu(tmp_path):
    from bigtrain.bench.cli import publish
    from bigtrain.bench.peak import sizes_for
    from bigtrain.bench.sweep import gpu_plan
    plan = gpu_plan(num_gpus=1, repeats=1)
    pairs = [c for c in plan.cases if c.group == "ratio"]
    assert (plan.mode, plan.ranks, len(pairs)) == ("gpu", 1, 14)
    assert len([c for c in gpu_plan(num_gpus=1, repeats=2).cases if c.group == "ratio"]) == 28
    assert {(c.workload.size, c.strategy.zero, c.runner) for c in pairs} == {
        (size, zero, runner) for size in ("small", "medium") for zero in (1, 2, 3) for runner in ("bigtrain", "deepspeed")
    } | {(size, 1, "nanogpt") for size in ("small", "medium")}
    assert all(c.workload.seq_len == 1024 and c.workload.precision == "bf16" and c.workload.vocab_multiple == 64
               for c in pairs)
    levers = [c for c in plan.cases if c.group == "lever"]
    assert {c.setting for c in levers} == {"compile off", "plain loss", "overflow check on", "vocabulary unpadded",
                                           "micro_batch auto", "compile at ZeRO-3", "deepcompile"}
    assert all(c.base == "gpt2-small" and c.runner == "bigtrain" for c in levers)
    assert {c.strategy.zero for c in levers if c.setting == "deepcompile"} == {1, 2, 3}
    with pytest.raises(ValueError, match="needs a GPU"):
        gpu_plan(num_gpus=0)
    assert sizes_for("cpu") == (1024, 2048) and min(sizes_for("cuda")) >= 4096
    # The GPU results go to their own section; the CPU sweep's section and plots stay as they were.
    rows = [make_row(_result("bigtrain", 12.0, world_size=1), PEAKS), make_row(_result("deepspeed", 10.0, world_size=1), PEAKS)]
    meta = {"mode": "gpu", "command": "bigtrain bench --gpu", "minutes": 6.0, "ranks": 1, "device": "NVIDIA H100",
            "peak_sizes": [4096, 8192], "peaks": PEAKS, "env_summary": "one NVIDIA H100 per rank", "load": {},
            "host": {"cpu": "x", "cores": 16, "memory_gib": 125.9, "amx": True, "avx512_bf16": True, "date": "d"}}
    page = tmp_path / "benchmarks.md"
    page.write_text("<!-- bench:sweep begin -->\nCPU\n<!-- bench:sweep end -->\n")
    assert publish({"meta": meta, "rows": rows, "ratios": ratios(rows)}, page, tmp_path / "img") == []
    text = page.read_text()
    assert "CPU" in text and "Accelerator: **NVIDIA H100**" in text and "4096/8192 squares" in text
    assert "**1.200** (ok)" in text and "peak GPU memory/rank" in text and "MFU fp32" not in text
    assert not (tmp_path / "img").exists()


@pytest.mark.parametrize("limit,guess", [(17, 8), (17, 40), (1, 5), (30, 30)])
def test_capacity_search_finds_the_boundary(limit, guess):
    probed = []

    def fits(n):
        probed.append(n)
        return n <= limit

    ok, bad = search_depth(fits, guess, max_probes=12)
    assert (ok, bad) == (limit, limit + 1)
    assert len(probed) <= 12 and len(set(probed)) == len(probed)


def _in_child(code: str, **env: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **env},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) != os.cpu_count()
                    or os.cpu_count() < 2, reason="needs an unrestricted affinity over >= 2 cores")
def test_each_rank_binds_itself_to_its_share_of_the_cores():
    code = ("import os, threading, torch; from bigtrain.distributed.host import bind_to_cores; "
            "done = threading.Event(); t = threading.Thread(target=done.wait); t.start(); "  # a thread that runs
            "mine = bind_to_cores(1, 2); tid = t.native_id; "
            "print(mine, sorted(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(tid)), torch.get_num_threads()); "
            "done.set()")
    cores = sorted(os.sched_getaffinity(0))
    share = cores[len(cores) // 2:len(cores) // 2 * 2]
    assert _in_child(code) == f"{share} {share} {share} {min(len(share), os.cpu_count())}"
    assert _in_child(code, BIGTRAIN_BIND_CORES="0").startswith(f"None {cores}")


def test_runner_env_and_ranks_keep_freed_memory():
    from bigtrain.launch.train import MALLOC_TUNABLES, thread_env
    assert thread_env(2)["GLIBC_TUNABLES"] == MALLOC_TUNABLES if "GLIBC_TUNABLES" not in os.environ else True
    assert _in_child("from bigtrain.distributed.host import keep_freed_memory; print(keep_freed_memory())",
                     GLIBC_TUNABLES="") == "True"
    assert _in_child("from bigtrain.distributed.host import keep_freed_memory; print(keep_freed_memory())",
                     GLIBC_TUNABLES=MALLOC_TUNABLES) == "False"  # the environment already did it


def test_jobs_that_offload_give_freed_memory_back():
    from bigtrain.train.job_config import offloads_to_host
    from bigtrain.launch.train import MALLOC_TUNABLES
    assert offloads_to_host({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})
    assert not offloads_to_host({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}}})
    assert not offloads_to_host({})
    script = """
import psutil, torch
from bigtrain.distributed.host import return_freed_memory
rss = lambda: psutil.Process().memory_info().rss
def cycle():
    t = torch.ones(64 * 2**20 // 4)
    del t
    return rss()
base = rss()
kept = cycle() - base
restored = return_freed_memory()
print(restored, kept > 48 * 2**20, cycle() - base < 16 * 2**20)
"""
    assert _in_child(script, GLIBC_TUNABLES=MALLOC_TUNABLES) == "True True True"  # kept, then handed back
    assert _in_child(script, GLIBC_TUNABLES=MALLOC_TUNABLES, BIGTRAIN_MALLOC_TUNING="1") == "False True False"


def test_gpu_dry_run_is_the_gpu_plan_on_the_tiniest_model_without_cuda_only_cases():
    from bigtrain.bench.jobs import ds_config_for
    from bigtrain.bench.sweep import DRY_STEPS, gpu_plan
    gpu, dry = gpu_plan(num_gpus=1), gpu_plan(num_gpus=0, dry=True)
    assert (dry.mode, dry.ranks) == ("gpu-dry", 1)
    small = [c for c in gpu.cases if c.workload.family == "gpt2" and c.workload.name.startswith("gpt2-small")
             and c.setting != "deepcompile"]
    dry_gpt2 = [c for c in dry.cases if c.workload.family == "gpt2"]
    def shape(cases):  # micro_batch auto's global batch scales with the micro-batch: the keys only
        return [(c.runner, c.strategy.label, c.group, c.setting, [k for k, _ in c.sets], c.ds_sets) for c in cases]
    assert shape(dry_gpt2) == shape(small)
    assert [c.workload.vocab_multiple for c in dry_gpt2] == [c.workload.vocab_multiple for c in small]
    assert all(c.steps == DRY_STEPS and c.workload.overrides == {"n_layer": 2, "n_embd": 64, "n_head": 2}
               for c in dry_gpt2)
    llama = [c for c in dry.cases if c.workload.family == "llama" and c.group == "efficiency"]  # the Llama 1B MFU row
    assert [(c.runner, c.strategy.label) for c in llama] == [("bigtrain", "z1")]
    assert "model.overrides.vocab_multiple" not in " ".join(llama[0].run_overrides())  # Llama takes no padding
    overflow = next(c for c in dry.cases if c.setting == "overflow check on")
    ds = ds_config_for(overflow, 1, breakdown=False)  # measured GPU jobs: no synchronizing wall-clock breakdown
    assert ds["bf16"] == {"enabled": True, "check_grad_overflow": True} and ds["wall_clock_breakdown"] is False
    auto = next(c for c in dry.cases if c.setting == "micro_batch auto")
    assert ("batch.micro_batch", "auto") in auto.sets and ("batch.global_batch", "8") in auto.sets


def test_mfu_against_the_datasheet_and_each_lever_against_bigtrains_defaults():
    from bigtrain.bench.levers import lever_ratios
    from bigtrain.bench.peak import datasheet_bf16_tflops
    from bigtrain.bench.table import jobs_table, levers_table
    assert [datasheet_bf16_tflops(n) for n in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200",
                                                 "NVIDIA A100-SXM4-80GB", "NVIDIA L4", "NVIDIA L40S", "cpu")] == [
        989.0, 756.0, 989.0, 312.0, 121.0, 362.0, None]
    peaks = {**PEAKS, "datasheet_bf16": 0.2}
    rows = [make_row(_result("bigtrain", s), peaks) for s in (10.0, 12.0)]
    rows += [make_row(_result("deepspeed", 10.0), peaks), make_row(_result("nanogpt", 8.0), peaks)]
    rows += [make_row(_result("bigtrain", 8.0, group="lever", setting="compile off", base_workload="t"), peaks),
             make_row(_result("bigtrain", 13.2, group="lever", setting="micro_batch auto", base_workload="t"), peaks)]
    assert rows[0]["mfu_datasheet"] == pytest.approx(0.01 / (0.2 * 2))
    (rec,) = ratios(rows)  # lever rows are not bigtrain's defaults: the ratio uses 10 and 12 only
    assert rec["bigtrain"] == pytest.approx(11.0) and rec["vs_nanogpt"] == pytest.approx(11.0 / 8.0)
    assert "| bigtrain / nanoGPT |" in ratio_table([rec]) and "| 1.38 |" in ratio_table([rec])
    gains = {r["lever"]: r["gain"] for r in lever_ratios(rows)}
    assert gains == pytest.approx({"compile off": 11.0 / 8.0, "micro_batch auto": 13.2 / 11.0})
    assert "**x1.38**" in levers_table(lever_ratios(rows)) and "**x1.20**" in levers_table(lever_ratios(rows))
    assert "MFU datasheet" in jobs_table(rows, fp32_mfu=False) and "bigtrain (compile off)" in jobs_table(rows)


def test_the_gpu_plan_ends_with_the_longest_sequences_one_device_trains_with_every_lever():
    """The long-sequence plan: Llama-1B (every weight) and Llama-8B (LoRA) at growing lengths, every lever on, on one GPU only
    (a rung is one device's question), last (its steps are long); the dry run has the same cases on a tiny Llama.
    A rung out of memory is the ladder's finding, not a failed bench; the table extrapolates the per-token slope."""
    from bigtrain.bench.longest import EVERY_LEVER, longest_cases, longest_table
    from bigtrain.bench.sweep import gpu_plan
    plan = gpu_plan(1)
    long = [c for c in plan.cases if c.group == "longest"]
    assert long == plan.cases[-len(long):] and not [c for c in gpu_plan(2).cases if c.group == "longest"]
    assert [(c.workload.size, c.workload.seq_len) for c in long] == [
        ("1b", 32768), ("1b", 65536), ("1b", 131072), ("8b", 16384), ("8b", 32768), ("8b", 65536)]
    for case in long:
        sets = dict(case.sets)
        assert all(sets[k] == v for k, v in EVERY_LEVER) and case.strategy.checkpointing
        assert case.strategy.zero == 3 and case.strategy.offload == "optimizer" and case.workload.micro_batch == 1
        assert (sets.get("lora.r") == "16") == (case.workload.size == "8b")
    dry = longest_cases(dry=True)
    assert [c.workload.seq_len for c in dry] == [64, 128, 64, 128] and all(c.workload.size == "custom" for c in dry)
    rows = [{"group": "longest", "workload": "llama-1b", "strategy": "z3", "setting": f"{n} tokens", "ok": ok,
             "tokens_per_sample": n, "peak_rss_bytes": 1e9 + 1e4 * n, "step_s": 1.0, "out_of_memory": not ok,
             "case": f"llama-1b {n}", "runner": "bigtrain", "precision": "bf16", "error": "exit code 1"}
            for n, ok in ((1000, True), (2000, True), (4000, False))]
    table = longest_table(rows, device_bytes=2e9)
    assert "| llama-1b | z3 | 4000 | - | out of memory |" in table
    assert "| 2000 | 1.0 GB | 1.0 s/step | 9.8 KiB/token: ~78K tokens fit |" in table  # 2000 + 0.78e9 / 1e4
    assert check_rows([make_row({**r, "log_tail": "torch.OutOfMemoryError: CUDA out of memory"}, PEAKS)
                       for r in rows if not r["ok"]], PEAKS) == []


@pytest.mark.parametrize("plan_name", ["short", "full", "gpu", "gpu-dry"])
def test_every_case_of_every_bench_plan_resolves(plan_name, monkeypatch):
    """What each bench job will be given, resolved as the bench resolves it before launching: a case that cannot
    (the micro_batch auto lever crashed `bench --gpu --dry-run` at its 12th case) fails here, not on a GPU lease."""
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)  # the suite's (tests/conftest.py); a bench host has none
    from bigtrain.bench.jobs import ds_config_for
    from bigtrain.bench.sweep import full_plan, gpu_plan, short_plan
    from bigtrain.ds.lint import DeviceCaps
    plan = {"short": short_plan, "full": full_plan, "gpu": lambda: gpu_plan(1),
            "gpu-dry": lambda: gpu_plan(0, dry=True)}[plan_name]()
    device = DeviceCaps("cuda", fp16=True, bf16=True) if plan_name == "gpu" else None  # a GPU host's abilities
    assert plan.cases
    for case in plan.cases:
        ds = ds_config_for(case, plan.ranks, device=device)
        micro, accum = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
        stages = case.strategy.pipeline
        assert ds["train_batch_size"] == micro * accum * (plan.ranks // stages), (case.name, ds)


def test_the_hosts_cpu_is_described_once_per_process(monkeypatch, tmp_path):
    """DeepSpeed's CPU Adam asks py-cpuinfo for the host's CPU six times, each answer a Python process of its own (3 of
    an offloaded tiny job's 10 CPU seconds): after `describe_cpu_once` the first answer serves them all, each caller
    its own copy."""
    import cpuinfo

    from bigtrain.distributed.host import describe_cpu_once
    monkeypatch.setenv("BIGTRAIN_CACHE", str(tmp_path))
    asked = []
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: asked.append(1) or {"vendor_id_raw": "x", "flags": ["avx2"]})
    describe_cpu_once()
    describe_cpu_once()  # a second job in the same process keeps the first wrapper
    answers = [cpuinfo.get_cpu_info() for _ in range(6)]
    assert len(asked) == 1 and all(a == {"vendor_id_raw": "x", "flags": ["avx2"]} for a in answers)
    answers[0]["flags"].append("changed")
    assert cpuinfo.get_cpu_info()["flags"] == ["avx2"]


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="the description is kept by what /proc/cpuinfo says")
def test_the_hosts_cpu_description_is_kept_for_the_machines_next_processes(monkeypatch, tmp_path):
    """The next process on this machine reads the kept description instead of asking py-cpuinfo (~1 CPU s and 1.1 s
    of its start); a kept file that is not a description is asked anew and replaced; BIGTRAIN_CACHE=off keeps none."""
    import cpuinfo

    from bigtrain.distributed.host import kept_cpu_description
    monkeypatch.setenv("BIGTRAIN_CACHE", str(tmp_path))
    asked = []

    def ask() -> dict:
        asked.append(1)
        return {"vendor_id_raw": "AuthenticAMD", "flags": ["avx2", "avx512f"]}
    first = kept_cpu_description(ask)
    assert kept_cpu_description(ask) == first and len(asked) == 1  # a later process: the kept file
    (kept,) = (tmp_path / "cpu").glob("*.json")
    kept.write_text("{half a description")
    assert kept_cpu_description(ask) == first and len(asked) == 2 and json.loads(kept.read_text()) == first
    monkeypatch.setattr(cpuinfo, "CPUINFO_VERSION_STRING", "another")  # another py-cpuinfo: its own answer
    kept_cpu_description(ask)
    assert len(asked) == 3 and len(list((tmp_path / "cpu").glob("*.json"))) == 2
    monkeypatch.setenv("BIGTRAIN_CACHE", "off")
    kept_cpu_description(ask)
    kept_cpu_description(ask)
    assert len(asked) == 5
