"""`bigtrain bench` end to end through the real launcher: the short CPU sweep (its table, plots and sane
numbers) and the GPU plan's dry run on CPU (the nanoGPT loop and a lever); the pieces are tests/unit/test_bench.py.

Each job is a launch of its own, as the bench runs them: ~90 and ~60 CPU seconds, which a busy 2-core machine
stretched to 236 and 185 s of wall time (a run of the suite timed out at 300 s). The time limit here is a guard
against a hang, under pytest's 600 s; what the tests cost is held by tests/budgets.py."""
import json
import math
import os
import subprocess
import sys

import pytest

from launch import REPO, rank_env

HANG_S = 540
# The dry run's cases: GPT-2 small's bigtrain and nanoGPT rows at ZeRO-1 (not the Llama 1B efficiency row, whose
# name ends alike: its Llama trains in the longest-sequence rungs here), a lever, a rung of each ladder, GRPO.
DRY_CASES = r"small \(dry\) z1 (bigtrain|nanogpt)$|overflow check|64 tokens$|grpo .* partitioned$"


@pytest.mark.slow
def test_short_bench_writes_a_sane_table_and_plots(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bigtrain.bench", "--short", "--workdir", str(tmp_path)],
                          cwd=REPO, env={**rank_env(), "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for noise in ("Setting accelerator", "Attempting to get learning rate"):  # DeepSpeed's: in logs/bench.log
        assert noise not in proc.stdout + proc.stderr, noise
    report = json.loads((tmp_path / "benchmarks.json").read_text())
    assert report["problems"] == []
    rows = report["rows"]
    assert {(r["runner"], r["strategy"]) for r in rows} == {("bigtrain", "z1"), ("deepspeed", "z1"), ("ddp", "z0"),
                                                            ("bigtrain", "z3")}
    for row in rows:
        assert row["ok"] and 0 < row["mfu"] <= 1 and math.isfinite(row["samples_per_s"]) and row["samples_per_s"] > 0
        assert row["model_state_bytes"] > 0 and row["peak_rss_bytes"] > row["model_state_bytes"]
    gpt2 = [r for r in rows if r["workload"] == "gpt2-tiny"]
    assert len({r["num_params"] for r in gpt2}) == 1  # every runner trained the same model
    assert {"forward", "backward", "step"} <= set(next(r for r in gpt2 if r["runner"] == "bigtrain")["split_ms"])
    (rec,) = report["ratios"]
    assert rec["ratio"] > 0.3 and rec["vs_ddp"] > 0  # a smoke bound: tiny jobs on a shared CI host are noisy
    page = (tmp_path / "benchmarks.md").read_text()
    assert "<!-- bench:sweep begin -->" in page and "| gpt2-tiny | z1 |" in page and "bigtrain / DeepSpeed" in page
    for name in ("throughput", "mfu", "memory", "step_split", "vs_baselines"):
        png = tmp_path / "img" / f"bench_{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gpu_dry_run_trains_the_nanogpt_loop_a_lever_the_longest_sequence_ladders_and_grpo_on_cpu(tmp_path):
    """The GPU plan's code paths on this host: the nanoGPT loop, a lever, the longest-sequence ladders (Llama-1B
    and Llama-8B with LoRA, every lever on: ZeRO-3 with the optimizer offloaded, checkpointed hidden states in host
    memory, the tiled MLP, the chunked loss) and GRPO generating with its ZeRO-3 weights left partitioned (the
    online case's other half, gathered, differs by that one setting) on a tiny Llama, so that they do not fail on a
    GPU lease for a silly reason."""
    proc = subprocess.run([sys.executable, "-m", "bigtrain.bench", "--gpu", "--dry-run", "--workdir", str(tmp_path),
                           "--only", DRY_CASES],
                          cwd=REPO, env={**rank_env(), "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "benchmarks_gpu.json").read_text())
    long = [r for r in report["rows"] if r["group"] == "longest"]
    assert [(r["workload"], r["tokens_per_sample"], r["ok"]) for r in long] == [
        (f"{model} (dry)", 64, True) for model in ("llama-1b", "llama-8b LoRA r=16")]  # a rung of each ladder
    for slug in ("llama-1b-dry*64*", "llama-8b*64*"):
        log = next(tmp_path.glob(f"{slug}/log.txt")).read_text()
        assert "tiled MLP (activation_checkpointing.tiled_mlp=True)" in log and ("LoRA r=16" in log) == ("8b" in slug)
        ran = json.loads(next(tmp_path.glob(f"{slug}/summary.json")).read_text())["run_config"]
        assert ran["train"]["loss_impl"] == "chunked" and ran["activation_checkpointing"]["offload_hidden_states"]
    assert "### The longest sequence on one device, every lever on" in (tmp_path / "benchmarks.md").read_text()
    (grpo,) = [r for r in report["rows"] if r["group"] == "online"]
    assert grpo["ok"] and grpo["setting"] == "partitioned" and grpo["online"]["generation_tokens_per_s"] > 0
    assert 12 <= grpo["online"]["mean_completion_length"] <= 16  # random weights: few draw their end-of-text
    ran = json.loads(next(tmp_path.glob("*grpo*partitioned/summary.json")).read_text())
    assert ran["run_config"]["objective"]["ds3_gather_for_generation"] is False
    assert ran["model"]["num_params"] == 138048  # with its own vocabulary, 500 rows (the prompts' BPE at most 320)
    assert "### Online RL: GRPO's generation at ZeRO-3" in (tmp_path / "benchmarks.md").read_text()
    rows = {(r["runner"], r["setting"]): r for r in report["rows"] if r["group"] not in ("longest", "online")}
    assert len(rows) == len(report["rows"]) - 3 and {r["workload"] for r in rows.values()} == {"gpt2-small (dry)"}
    assert set(rows) == {("bigtrain", "bigtrain's defaults"), ("nanogpt", "bigtrain's defaults"),
                         ("bigtrain", "overflow check on")}
    assert all(r["ok"] and r["tokens_per_s"] > 0 and math.isfinite(r["final_loss"]) for r in rows.values())
    nanogpt = json.loads(next(tmp_path.glob("*nanogpt*/result_rank0.json")).read_text())
    assert nanogpt["compiled"] is False and len(nanogpt["losses"]) == 3  # a CPU: no compile, as bigtrain's default
    assert report["meta"]["mode"] == "gpu-dry" and report["meta"]["peaks"]["datasheet_bf16"] is None
    page = (tmp_path / "benchmarks.md").read_text()
    assert "| gpt2-small (dry) | bf16 | z1 | nanogpt |" in page  # the ratio columns need a DeepSpeed pair (unit test)
    assert "### Each lever on its own" in page and "| overflow check on |" in page and "| **x" in page


def test_trl_dry_run_trains_grpo_with_trls_trainer_and_bigtrain_on_the_same_settings(tmp_path):
    """`bigtrain bench --trl --dry-run --only grpo`: TRL's GRPOTrainer and `bigtrain train` on the same tiny Llama,
    prompts and settings, one process each (the levers' cases: tests/unit/test_bench_trl.py); each side's settings
    as its own objects report them agree, and the page holds the side-by-side tables."""
    proc = subprocess.run([sys.executable, "-m", "bigtrain.bench", "--trl", "--dry-run", "--only", "grpo",
                           "--workdir", str(tmp_path)], cwd=REPO, env={**rank_env(), "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads((tmp_path / "benchmarks_trl.json").read_text())["results"]
    assert [(r["runner"], r["setting"]) for r in results] == [("bigtrain", ""), ("trl", "")]
    for r in results:
        assert r["ok"] and r["step_s"] > 0 and r["tokens_per_s"] > 0 and 0 < r["time_to_first_step_s"] < r["wall_s"]
    mine, theirs = results[0]["settings"], results[1]["settings"]
    for key in ("betas", "eps", "weight_decay", "grad_clip", "micro_batch", "grad_accum", "processes", "seed", "dtype",
                "beta", "loss_type", "num_generations", "max_completion_length", "temperature", "top_p", "top_k",
                "epsilon_low", "epsilon_high", "num_iterations", "scale_rewards", "importance_sampling_level",
                "mask_truncated_completions", "generation_batch_size", "steps_per_generation"):
        assert mine[key] == theirs[key], (key, mine[key], theirs[key])
    assert results[0]["lrs"] == results[1]["lrs"] == [1e-5] * 3  # the rate each applied at each step
    assert 1 < results[0]["online"]["mean_completion_length"] < 48  # the base ends completions at mixed lengths
    page = (tmp_path / "benchmarks.md").read_text()
    assert "**Dry run**" in page and "| GRPO |" in page and "### GRPO: the settings each side ran with" in page
    assert "| micro-batches per round (steps_per_generation) | 2 | 2 |" in page


def test_one_rank_starts_as_deepspeeds_per_node_launcher_starts_it(tmp_path):
    """The bench's one-rank jobs start without the launcher: the rank's arguments and the launcher's variables are
    those DeepSpeed's own per-node launcher gives it (run here once, on a script that reports them)."""
    from bigtrain.launch.node import machine_command, node_launch_command
    script = tmp_path / "report.py"
    script.write_text("import json, os, sys\nprint(json.dumps({'argv': sys.argv[1:], 'env': dict(os.environ)}))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                            "MASTER_PORT", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE")}
    env["DS_ACCELERATOR"] = "cpu"

    def reported(cmd: list[str], extra: dict) -> dict:
        proc = subprocess.run(cmd, env={**env, **extra}, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout.splitlines()[-1])
    theirs = reported(node_launch_command(1, 29533, [str(script), "--x", "1"], log_level="error"), {})
    cmd, extra = machine_command(1, 29533, [str(script), "--x", "1"])
    ours = reported(cmd, extra)
    assert ours["argv"] == theirs["argv"] == ["--local_rank=0", "--x", "1"]
    # every variable the launcher adds, and no other, but the devices it narrows to the first and what importing
    # DeepSpeed sets in its own process
    added = {k: v for k, v in theirs["env"].items() if env.get(k) != v}
    assert {k: v for k, v in added.items() if k not in ("CUDA_VISIBLE_DEVICES", "PYTORCH_NVML_BASED_CUDA_CHECK")} \
        == extra, (added, extra)
    assert machine_command(2, 29533, ["m"], module=True) == (node_launch_command(2, 29533, ["m"], module=True), {})
