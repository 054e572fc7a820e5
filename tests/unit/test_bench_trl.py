"""`bigtrain bench --trl` (bigtrain/bench/trl_*.py, baseline_trl.py) without running a job: the plan's order, the
settings each side is given (bigtrain's run config and TRL's config arguments from the one `Settings`), how a job's
files become its seconds per step, tokens/s and time to the first step (both sides read alike), and the page's
tables. The bench end to end, TRL's trainers included: tests/dist/test_bench_runs.py's --trl --dry-run."""
from __future__ import annotations

import ast
import json
from pathlib import Path
from dataclasses import replace
from types import SimpleNamespace

import pytest

from bigtrain.bench import trl_bench, trl_cases, trl_report
from bigtrain.bench.trl_cases import SETTINGS, Case, Workload, bigtrain_sets, plan, trl_job

WORK = Workload(Path("/models/base"), Path("/d/chat.jsonl"), Path("/d/pairs.jsonl"), Path("/d/prompts.jsonl"))


def test_the_plan_alternates_each_pairs_order_and_puts_the_levers_beside_the_pairs_bigtrain_job():
    cases = plan(2, only="sft|grpo")
    names = [(c.objective, c.runner, c.setting, c.rep) for c in cases]
    assert names[:4] == [("sft", "bigtrain", "", 0), ("sft", "trl", "", 0),
                         ("sft", "bigtrain", "rows padded to data.seq_len", 0),
                         ("sft", "bigtrain", "started through the deepspeed launcher", 0)]
    assert names[4:6] == [("sft", "trl", "", 1), ("sft", "bigtrain", "", 1)]  # the second pair: TRL first
    assert {c.objective for c in cases} == {"sft", "grpo"} and len({c.slug for c in cases}) == len(cases)
    dry = plan(5, dry=True)
    assert {c.rep for c in dry} == {0} and {c.settings.steps for c in dry} == {trl_cases.DRY_STEPS}
    assert [(c.objective, c.runner, c.setting) for c in dry] == [  # one pair per objective, as --help says
        (objective, runner, "") for objective in ("sft", "dpo", "grpo") for runner in ("bigtrain", "trl")]


def run_config(case: Case):
    from bigtrain.config.flags import build_run_parser, run_config_from_args
    args = bigtrain_sets(case, WORK, Path("/tmp/out"))
    assert args[:2] == ["--num-gpus", "1"]
    flags = [a for a in args[2:] if a.startswith("--launcher")]
    rest = [a for a in args[2:] if a not in flags]
    return run_config_from_args(build_run_parser().parse_args(rest)), flags


@pytest.mark.parametrize("objective", ["sft", "dpo", "grpo"])
def test_both_sides_get_the_same_settings(objective):
    s = SETTINGS[objective]
    run, flags = run_config(Case(objective, "bigtrain", s))
    assert flags == [] and (run.precision, run.train.seed, run.model.pretrained) == ("fp32", s.seed, "/models/base")
    o = run.optimizer
    assert (o.lr, tuple(o.betas), o.eps, o.weight_decay, o.grad_clip) == (s.lr, s.betas, s.eps, s.weight_decay,
                                                                          s.grad_clip)
    assert (run.schedule.kind, run.schedule.min_lr_ratio) == ("constant", 1.0)  # TRL's constant rate, no warm-up
    assert (run.batch.micro_batch, run.batch.grad_accum, run.data.seq_len) == (s.micro_batch, s.grad_accum,
                                                                               s.max_length)
    config = trl_job(Case(objective, "trl", s), WORK, Path("/tmp/out"))["config"]
    assert (config["learning_rate"], (config["adam_beta1"], config["adam_beta2"]), config["adam_epsilon"]) == (
        s.lr, s.betas, s.eps)
    assert (config["weight_decay"], config["max_grad_norm"], config["seed"], config["max_steps"]) == (
        s.weight_decay, s.grad_clip, s.seed, s.steps)
    assert (config["per_device_train_batch_size"], config["gradient_accumulation_steps"]) == (s.micro_batch,
                                                                                            s.grad_accum)
    assert (config["use_cpu"], config["bf16"], config["lr_scheduler_type"], config["warmup_steps"]) == (
        True, False, "constant", 0)
    assert set(config) <= trl_fields(objective)  # every argument is one of TRL's (read from its source, not imported)
    o = run.objective
    if objective == "sft":
        assert run.data.train_on_prompt and config["max_length"] == s.max_length  # TRL's messages: every token
    if objective == "dpo":
        assert (o.kind, o.beta, o.reference) == ("dpo", s.beta, "copy") and config["beta"] == s.beta
    if objective == "grpo":
        mine = (o.kind, o.num_generations, o.max_completion_length, o.temperature, o.loss_type, o.beta, o.epsilon)
        theirs = ("grpo", *(config[k] for k in ("num_generations", "max_completion_length", "temperature", "loss_type",
                                                 "beta", "epsilon")))
        assert mine == theirs == ("grpo", s.num_generations, s.max_completion_length, s.temperature, s.loss_type,
                                  s.beta, s.epsilon)


def trl_fields(objective: str) -> set[str]:
    """The field names of TRL's config class and transformers' TrainingArguments, from their sources."""
    import importlib.util
    names = set()
    for module in (f"trl.trainer.{objective}_config", "transformers.training_args"):
        tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
        names |= {node.target.id for node in ast.walk(tree)
                  if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    return names


def test_a_lever_changes_one_setting_and_the_launcher_lever_is_an_argument_of_bigtrain_train():
    grpo = {c.setting: c for c in plan(1, only="grpo") if c.setting}
    run, _ = run_config(grpo["transformers' generate (objective.decode=generate)"])
    assert run.objective.decode == "generate"
    run, _ = run_config(grpo["a round for 2 steps (objective.steps_per_generation=4)"])
    assert run.objective.steps_per_generation == 4
    sft = {c.setting: c for c in plan(1, only="sft") if c.setting}
    run, flags = run_config(sft["started through the deepspeed launcher"])
    assert flags == ["--launcher-arg=--master_addr=127.0.0.1"] and run.data.padding == "auto"
    assert run_config(sft["rows padded to data.seq_len"])[0].data.padding == "max_length"


def write_bigtrain(out: Path, started: float, lengths=None) -> None:
    """summary.json as a 5-step bigtrain run writes it (only what the bench reads)."""
    from dataclasses import asdict

    from bigtrain.config.load import load_run_config
    run = asdict(load_run_config(None, ["objective.kind=grpo", "objective.rewards=accuracy", "data.seq_len=96",
                                        "objective.max_completion_length=48", "precision=fp32"]))
    metrics = {"completions/mean_length": [[k + 1, n] for k, n in enumerate(lengths)]} if lengths else {}
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps({
        "step_times": [9.0, 3.0, 2.0, 2.0, 4.0], "first_step_end_unix": started + 30.0, "lrs": [1e-5] * 5,
        "step_end_cpu_s": [10.0, 11.5, 12.5, 13.5, 15.5],
        "metrics": metrics, "run_config": run, "world_size": 1,
        "ds_config": {"optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "betas": [0.9, 0.999], "eps": 1e-8,
                                                                 "weight_decay": 0.0, "torch_adam": True}},
                      "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": 16,
                      "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1},
                      "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-5}}}}))


def test_both_sides_files_are_read_alike(tmp_path):
    """Time to the first step from the command's start; seconds per step from step ends after the warm-up;
    tokens/s: SFT the data's tokens per record x records a step, GRPO completions x (prompt + that step's mean
    completion length)."""
    sft = Case("sft", "bigtrain", replace(SETTINGS["sft"], steps=5))
    tokens = {"sft": 100.0, "dpo": 200.0, "grpo": 20.0}
    write_bigtrain(tmp_path / "bt", started=1000.0)
    mine = trl_bench.read_bigtrain(tmp_path / "bt", 1000.0, sft, tokens)
    assert mine["time_to_first_step_s"] == 30.0 and mine["step_times"] == [3.0, 2.0, 2.0, 4.0]
    assert mine["step_s"] == 2.0 and mine["measured_steps"] == 3  # steps 3-5
    assert (mine["cpu_step_s"], mine["cpu_to_first_step_s"]) == (1.0, 10.0)  # CPU s at the step ends: 1, 1, 2
    assert mine["tokens_per_s"] == pytest.approx(16 * 100.0 / 2.0)
    assert mine["settings"]["lr_scheduler"] == "constant (DeepSpeed's WarmupLR, 1e-05 to 1e-05)"
    (tmp_path / "trl").mkdir()
    ends = [1040.0, 1043.0, 1045.0, 1047.0, 1051.0]  # the same step seconds, 10 s later
    log = [{"step": k + 1, "completions/mean_length": n, "learning_rate": 1e-5} for k, n in enumerate([48, 40, 30,
                                                                                                      20, 10])]
    (tmp_path / "trl" / "result.json").write_text(json.dumps({
        "started": 1001.0, "imported": 1010.0, "trainer_built": 1012.0, "step_end_unix": ends, "log": log,
        "step_end_cpu_s": [12.0, 13.5, 14.5, 15.5, 17.5],
        "settings": {"betas": [0.9, 0.999]}, "lrs": [1e-5] * 5, "versions": {}}))
    grpo = Case("grpo", "trl", replace(SETTINGS["grpo"], steps=5))
    theirs = trl_bench.read_trl(tmp_path / "trl", 1000.0, grpo, tokens)
    assert theirs["time_to_first_step_s"] == 40.0 and theirs["step_s"] == 2.0
    # steps 3-5: 32 x (20 + 30) / 2, 32 x (20 + 20) / 2, 32 x (20 + 10) / 4 -> the median 640
    assert theirs["tokens_per_s"] == pytest.approx(640.0) and theirs["startup"]["imports_s"] == 10.0
    assert theirs["cpu_to_first_step_s"] == 12.0 and theirs["tokens_per_cpu_s"] == pytest.approx(32 * 40 / 1.0)


def result(objective, runner, step_s, first, setting="", rep=0):
    return {"case": f"{objective} {runner} {setting}", "objective": objective, "runner": runner, "setting": setting,
            "ok": True, "step_s": step_s, "tokens_per_s": 100.0 / step_s, "time_to_first_step_s": first,
            "cpu_step_s": step_s / 2, "tokens_per_cpu_s": 200.0 / step_s, "cpu_to_first_step_s": first / 2,
            "wall_s": 60.0, "measured_steps": 10, "lrs": [1e-5, 1e-5], "rep": rep,
            "settings": {"betas": [0.9, 0.999], "eps": 1e-8, "loss_type": "dapo"}}


def test_the_page_states_bigtrain_over_trl_per_pair_the_levers_and_both_sides_settings():
    results = [result("grpo", "bigtrain", 1.0, 20.0), result("grpo", "trl", 1.5, 30.0),
               result("grpo", "bigtrain", 2.0, 10.0, "transformers' generate"),
               result("grpo", "trl", 2.0, 30.0, rep=1), result("grpo", "bigtrain", 1.0, 15.0, rep=1),
               result("grpo", "bigtrain", 1.0, 30.0, "transformers' generate", rep=1)]
    (rec,) = trl_report.summary(results)
    assert rec["speed_pairs"] == pytest.approx([1.5, 2.0]) and rec["speed"] == pytest.approx(1.75)
    assert rec["first_step_pairs"] == pytest.approx([1.5, 2.0])  # TRL's over bigtrain's: > 1, bigtrain earlier
    assert "| GRPO | 1.00 | 1.75 |" in trl_report.ratio_table([rec]) and "**1.75x**" in trl_report.ratio_table([rec])
    assert "| GRPO | 0.50 | 0.88 | **1.75x** | 1.50, 2.00 | 8.8 | 15.0 | **1.75x** | 1.50, 2.00 |" in \
        trl_report.cpu_table([rec])
    levers = trl_report.lever_table(results)
    assert "| GRPO | transformers' generate | **0.75** | 0.50, 1.00 | 0.75 | 0.50, 1.00 | 1.25 | 0.50, 2.00 | 1.25 |" \
        in levers
    table = trl_report.settings_table(results, "grpo")
    assert "| Adam betas | 0.9, 0.999 | 0.9, 0.999 |" in table and "| loss type | dapo | dapo |" in table
    assert "| learning rate applied, first and last step | 1e-05, 1e-05 | 1e-05, 1e-05 |" in table


def test_trls_settings_are_read_from_its_trainers_objects():
    from bigtrain.bench.baseline_trl import effective_settings
    group = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    args = SimpleNamespace(max_grad_norm=1.0, lr_scheduler_type=SimpleNamespace(value="constant"), warmup_steps=0,
                           per_device_train_batch_size=8, gradient_accumulation_steps=2, seed=1, disable_dropout=True,
                           max_length=256, padding_free=False, packing=False, assistant_only_loss=False,
                           completion_only_loss=None)
    param = SimpleNamespace(dtype="torch.float32")
    trainer = SimpleNamespace(args=args, optimizer=SimpleNamespace(optimizer=SimpleNamespace(param_groups=[group])),
                              model=SimpleNamespace(parameters=lambda: iter([param])),
                              accelerator=SimpleNamespace(num_processes=1, device="cpu"))
    got = effective_settings(trainer, "sft")
    assert got["betas"] == [0.9, 0.999] and got["lr_scheduler"] == "constant" and got["dtype"] == "float32"
    assert (got["micro_batch"], got["grad_accum"], got["max_length"], got["packing"]) == (8, 2, 256, False)
