"""Online RL's benchmarks: the GPU plan's GRPO cases (bigtrain/bench/online.py), how a run's
`time/PART` metrics become a step's split and generation tokens/s, and scripts/bench_online_rl.py's tables and page
section. The cases trained end to end are tests/dist/test_bench_runs.py's dry run."""
import importlib.util
import json
import re
import sys

import pytest

from launch import REPO

from bigtrain.bench.online import PARTS, online_cases, online_table, step_medians, write_prompts
from bigtrain.bench.rows import check_rows, make_row

PEAKS = {"bf16": 0.05, "fp32": 0.1}


def summary(gen=(9.0, 2.0, 3.0, 4.0), lengths=(10.0, 20.0, 30.0, 40.0), completions=16) -> dict:
    """summary.json of an online run logged at every step (only what step_medians and read_bigtrain read)."""
    steps = range(1, len(gen) + 1)
    metrics = {"time/generation": [[s, g] for s, g in zip(steps, gen)],
               "time/reference": [[s, 0.5] for s in steps], "time/rewards": [[s, 0.1 * s] for s in steps],
               "time/policy": [[s, 1.0] for s in steps],
               "completions/mean_length": [[s, n] for s, n in zip(steps, lengths)]}
    return {"metrics": metrics, "ds_config": {"train_batch_size": completions}, "time_split": {}}


def test_step_medians_skip_the_first_step_and_rate_each_steps_completion_tokens():
    got = step_medians(summary())
    assert got["parts_s"] == pytest.approx({"generation": 3.0, "reference": 0.5, "rewards": 0.3, "policy": 1.0})
    assert sum(got["shares"].values()) == pytest.approx(1.0) and got["shares"]["generation"] == pytest.approx(3 / 4.8)
    # steps 2-4: 16 x 20 / 2, 16 x 30 / 3, 16 x 40 / 4 = 160 each; the first step (9 s, one-off costs) left out
    assert got["generation_tokens_per_s"] == pytest.approx(160.0) and got["mean_completion_length"] == 30.0
    s = summary()
    del s["metrics"]["time/reference"]
    with pytest.raises(ValueError, match="no time/reference after step 1.*logging.interval=1"):
        step_medians(s)


def test_gpu_plan_generates_on_llama_1b_with_gathered_and_partitioned_weights_and_reads_its_prompts(tmp_path):
    from bigtrain.bench.sweep import gpu_plan
    for num_gpus in (1, 8):
        cases = [c for c in gpu_plan(num_gpus).cases if c.group == "online"]
        assert [c.setting for c in cases] == ["gathered", "partitioned"]
        for case in cases:
            sets = dict(o.split("=", 1) for o in case.run_overrides(tmp_path))
            assert sets["objective.kind"] == "grpo" and case.strategy.zero == 3 and case.workload.size == "1b"
            assert sets["objective.ds3_gather_for_generation"] == {"gathered": "true", "partitioned": "false"}[
                case.setting]
            assert sets["model.overrides.vocab_size"] == "128256"  # Llama's output layer, not the BPE's
            assert sets["data.source"] == str(tmp_path / "prompts.jsonl") and case.prompts >= 64
            assert int(sets["batch.global_batch"]) == 64 * num_gpus  # 8 prompts x 8 completions per GPU
            assert int(sets["data.seq_len"]) > int(sets["objective.max_completion_length"])
    dry = online_cases(1, dry=True)
    assert [c.workload.overrides["n_layer"] for c in dry] == [2, 2] and all(c.steps == 3 for c in dry)
    assert [c.setting for c in gpu_plan(0, dry=True).cases if c.group == "online"] == ["gathered", "partitioned"]
    records = [json.loads(line) for line in write_prompts(tmp_path / "p.jsonl", 5).read_text().splitlines()]
    a, b = map(int, re.findall(r"\d+", records[0]["prompt"]))
    assert len(records) == 5 and records[0]["answer"] == str(a + b)


def _online_result(setting: str, gen_s: float, ok: bool = True) -> dict:
    result = {"case": f"g {setting}", "runner": "bigtrain", "workload": "llama-1b grpo", "strategy": "z3",
              "group": "online", "precision": "bf16", "setting": setting, "ok": ok, "rc": 0 if ok else 1}
    if not ok:
        return {**result, "error": "exit code 1"}
    return {**result, "samples_per_s": 2.0, "step_s_median": 8.0, "losses": [0.1], "num_params": 10,
            "flops_per_sample": 1e9, "tokens_per_sample": 64, "global_batch": 16, "peak_rss_per_rank": [2e9],
            "model_state_bytes_per_rank": [1e9], "world_size": 1,
            "online": step_medians(summary(gen=(9.0, gen_s, gen_s, gen_s), lengths=(16.0,) * 4))}


def test_online_rows_carry_their_split_and_the_table_compares_partitioned_with_gathered():
    rows = [make_row(_online_result("gathered", 2.0), PEAKS), make_row(_online_result("partitioned", 8.0), PEAKS),
            make_row(_online_result("gathered", 0, ok=False), PEAKS)]
    assert rows[0]["online"]["generation_tokens_per_s"] == pytest.approx(16 * 16 / 2.0)
    table = online_table(rows)
    assert "| llama-1b grpo | z3 | gathered | 8.00 | 128 | 1.00 | 2.00 (53%) |" in table
    assert "| llama-1b grpo | z3 | partitioned | 8.00 | 32 | 0.25 | 8.00 (82%) |" in table
    assert "| gathered | failed: exit code 1 |" in table and all(f"{p} s" in table for p in PARTS)
    assert check_rows(rows[:2], PEAKS) == []


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("bench_online_rl", REPO / "scripts" / "bench_online_rl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _generation(world: int, plain: float, gathered: float, partitioned: float, same: bool = True) -> dict:
    rates = {"plain": plain, "gathered": gathered, "partitioned": partitioned}
    return {"world": world, "threads_per_rank": 1, "prompts": 8, "tokens_per_round": 384, "prompt_lengths": "8-24",
            "new_tokens": 48, "rounds": 3, "shape": {"num_hidden_layers": 4, "hidden_size": 256, "vocab_size": 2048},
            "tokens_per_s": rates, "seconds": {m: [384 / r] * 3 for m, r in rates.items()},
            "cpu_seconds": {m: [192 / r] * 3 for m, r in rates.items()},
            "same_tokens_as_plain": {"plain": True, "gathered": True, "partitioned": same}}


def test_the_script_writes_its_tables_into_the_pages_section_only(script, tmp_path, monkeypatch):
    grpo = {"name": "1 rank, gathered", "step_s_median": 1.5, "generation_tokens_per_s": 400.0,
            **{k: v for k, v in step_medians(summary()).items() if k in ("parts_s", "shares")}}
    results = {"started": "2026-11-28 17:40", "host": "vm", "cores": 2, "load_before": "5.0", "load_after": "6.0",
               "deepspeed": "0.19.8", "torch": "2.13", "transformers": "5.24", "steps": 8, "grpo": [grpo],
               "generation": [_generation(1, 800.0, 600.0, 200.0), _generation(2, 1200.0, 900.0, 100.0, same=False)]}
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n\n<!-- bench:online_rl begin -->\nold\n<!-- bench:online_rl end -->\n\nby hand\n")
    saved = tmp_path / "r.json"
    saved.write_text(json.dumps(results))
    monkeypatch.setattr(sys, "argv", ["bench_online_rl.py", "--from-json", str(saved), "--page", str(page)])
    script.main()
    text = page.read_text()
    assert "\nold\n" not in text and text.endswith("<!-- bench:online_rl end -->\n\nby hand\n")
    assert "| 1 rank, gathered | 1.50 | 3.00 (62%) | 0.50 (10%) | 0.30 (6%) | 1.00 (21%) | 400 |" in text
    assert "| 1 x 1 thread | ZeRO-3, gathered | 600 | 0.75 | 1.00 | 0.50 | 1200 | yes |" in text
    assert "| 2 x 1 thread | ZeRO-3, partitioned | 100 | 0.08 | 0.50 | 0.50 | 200 | **no** |" in text
    assert "load average 5.0 before and 6.0 after" in text and "8 prompts of 8-24 tokens, 48 new tokens" in text
