"""Defaults that fit the job: the learning rate, weight decay and warm-up a run sets none of are
chosen by what the run is (bigtrain.config.defaults), each objective declaring its fine-tuning rate (TRL's, held to
TRL's own config classes here), LoRA's 10x, a user's value kept whatever its source and said as theirs in the start
line (bigtrain.config.provenance), and a resume keeping the rate its run started with."""
from __future__ import annotations

import importlib
import json
import logging
from pathlib import Path

import pytest

from launch import REPO

from bigtrain.config import provenance
from bigtrain.config.load import field_sources, load_run_config
from bigtrain.ds.lint import DeviceCaps
from bigtrain.ds.resolve import resolve
from bigtrain.objectives import OBJECTIVES

CPU = DeviceCaps("cpu", fp16=False, bf16=True)
# objective.kind -> the TRL 1.16 config class whose defaults it follows (module, class)
TRL_CONFIGS = {"lm": ("trl", "SFTConfig"), "dpo": ("trl", "DPOConfig"), "ipo": ("trl", "DPOConfig"),
               "orpo": ("trl.experimental.orpo", "ORPOConfig"), "simpo": ("trl.experimental.cpo", "CPOConfig"),
               "kto": ("trl", "KTOConfig"), "reward": ("trl", "RewardConfig"), "grpo": ("trl", "GRPOConfig"),
               "rloo": ("trl", "RLOOConfig"), "distill": ("trl", "DistillationConfig")}
# the rates as docs/fine-tuning.md states them (TRL 1.16's defaults; LoRA: TRL's PEFT guide, 10x)
STATED = {"lm": 2e-5, "dpo": 1e-6, "ipo": 1e-6, "orpo": 1e-6, "simpo": 1e-6, "kto": 1e-6, "reward": 1e-4,
          "grpo": 1e-6, "rloo": 1e-6, "distill": 1e-6}
# what a kind needs besides itself to load (online RL: a reward or a teacher, room for its completions)
NEEDED = {**{kind: ["objective.rewards=accuracy", "data.seq_len=1024"] for kind in ("grpo", "rloo")},
          "distill": ["objective.teacher=/models/teacher", "data.seq_len=1024"]}


def kind_sets(kind: str) -> list[str]:
    return [f"objective.kind={kind}", *NEEDED.get(kind, [])]


@pytest.fixture
def weights(tmp_path) -> Path:
    """A model directory holding weights: a run from it fine-tunes (its files are not read by the run config)."""
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def hyper(run) -> tuple[float, float, int]:
    return run.optimizer.lr, run.optimizer.weight_decay, run.schedule.warmup_steps


def test_every_objective_declares_its_fine_tuning_defaults_after_a_trl_config():
    """A new objective must say which TRL trainer's defaults it follows (grpo, rloo: GRPOConfig, RLOOConfig)."""
    assert set(TRL_CONFIGS) >= set(OBJECTIVES), f"add the TRL config of {set(OBJECTIVES) - set(TRL_CONFIGS)}"
    assert all(cls.fine_tuning is not None for cls in OBJECTIVES.values())


@pytest.mark.parametrize("kind", sorted(OBJECTIVES))
def test_each_objective_fine_tunes_at_trls_rate_with_trls_weight_decay(kind, weights):
    module, name = TRL_CONFIGS[kind]
    trl = getattr(pytest.importorskip(module), name)
    fields = trl.__dataclass_fields__
    run = load_run_config(None, [f"model.pretrained={weights}", *kind_sets(kind)])
    assert run.optimizer.lr == fields["learning_rate"].default == STATED.get(kind, run.optimizer.lr)
    assert run.optimizer.weight_decay == fields["weight_decay"].default == 0.0
    assert run.optimizer.betas == (fields["adam_beta1"].default, fields["adam_beta2"].default) == (0.9, 0.999)
    # TRL warms up none: the peak rate from the first step (test_no_warm_up_starts_at_the_peak)
    assert fields["warmup_steps"].default == 0 and run.schedule.warmup_steps == 0


@pytest.mark.parametrize("kind", sorted(OBJECTIVES))
def test_lora_fine_tunes_at_ten_times_the_rate(kind, weights):
    full = load_run_config(None, [f"model.pretrained={weights}", *kind_sets(kind)])
    lora = load_run_config(None, [f"model.pretrained={weights}", *kind_sets(kind), "lora.r=8"])
    assert lora.optimizer.lr == pytest.approx(10 * full.optimizer.lr, rel=1e-12)
    assert hyper(lora)[1:] == (0.0, 0)


def test_the_docs_table_gives_each_objectives_defaults():
    """docs/fine-tuning.md's table has a row for every kind, with the rates, weight decay and warm-up it declares."""
    rows = [line.split("|")[1:-1] for line in (REPO / "docs" / "fine-tuning.md").read_text().splitlines()
            if line.startswith("| `")]
    for kind, cls in OBJECTIVES.items():
        row = next((r for r in rows if f"`{kind}`" in r[0]), None)
        assert row is not None, f"docs/fine-tuning.md: no row for objective.kind={kind}"
        tuning = cls.fine_tuning
        assert (float(row[1]), float(row[2]), float(row[3])) == pytest.approx(
            (tuning.lr, tuning.rate(lora=True), tuning.weight_decay), rel=1e-9), (kind, row)
        assert tuple(map(float, row[4].split(","))) == tuning.betas, row
        assert row[5].strip() == ("none" if tuning.warmup_steps == 0 else f"{tuning.warmup_steps} step"
                                  + ("s" if tuning.warmup_steps > 1 else "")), row


def test_trls_peft_guide_rates_for_lora():
    """TRL's docs (peft_integration.md: SFT 2e-4, GRPO 1e-5; reward_trainer.md: about 1e-3 for adapters)."""
    from bigtrain.config.defaults import choose
    assert choose("/somewhere", "lm", lora=True).lr == pytest.approx(2e-4)
    assert choose("/somewhere", "reward", lora=True).lr == pytest.approx(1e-3)


@pytest.mark.parametrize("kind", sorted(OBJECTIVES))
def test_from_random_weights_the_pretraining_defaults_whatever_the_objective(kind):
    run = load_run_config(None, kind_sets(kind))
    assert hyper(run) == (6e-4, 0.1, 20) and run.optimizer.betas == (0.9, 0.95)
    assert "the pretraining defaults: no model.pretrained" in provenance.describe(run, {})


def test_a_directory_without_weights_trains_from_random_weights_at_the_pretraining_defaults(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    run = load_run_config(None, [f"model.pretrained={tmp_path}", "objective.kind=dpo", "lora.r=8"])
    assert hyper(run) == (6e-4, 0.1, 20)
    assert f"{tmp_path} holds no weights" in provenance.describe(run, {})


def test_a_fine_tuning_run_says_its_defaults_and_why(weights):
    run = load_run_config(None, [f"model.pretrained={weights}", "objective.kind=dpo", "lora.r=8", "train.steps=50"])
    line = provenance.describe(run, {})
    assert line.startswith("adamw: lr 1e-05, weight decay 0, betas (0.9, 0.999), no warm-up (the fine-tuning "
                           "defaults of objective.kind=dpo from a pretrained model with LoRA adapters; set "
                           "optimizer.lr, optimizer.weight_decay, optimizer.betas, schedule.warmup_steps to change: "
                           "docs/fine-tuning.md)"), line
    assert line.endswith("cosine decay to 10% of the peak by step 50 (bigtrain's default)"), line


def test_what_a_user_sets_in_a_file_or_by_set_is_kept_and_said_as_theirs(weights, tmp_path):
    yaml = tmp_path / "run.yaml"
    yaml.write_text("optimizer:\n  weight_decay: 0.05\nschedule:\n  kind: constant\n")
    sets = [f"model.pretrained={weights}", "optimizer.lr=3e-5"]
    run = load_run_config(yaml, sets)
    assert hyper(run) == (3e-5, 0.05, 0)
    line = provenance.describe(run, provenance.provenance(field_sources(yaml, sets), frozenset()))
    assert line == ("adamw: lr 3e-05 (your --set); weight decay 0.05 (your config file); betas (0.9, 0.999), no "
                    "warm-up (the fine-tuning defaults of objective.kind=lm from a pretrained model; set "
                    "optimizer.betas, schedule.warmup_steps to change: docs/fine-tuning.md); then constant (your "
                    "config file)"), line


def resolved_with(user_json: dict | None, sets: list[str]):
    run = load_run_config(None, sets)
    return resolve(run, user_json, 1, CPU, sources=field_sources(None, sets))


def test_a_deepspeed_jsons_optimizer_and_scheduler_are_kept_and_said_as_theirs(weights):
    user = {"train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 7, "total_num_steps": 100}}}
    resolved = resolved_with(user, [f"model.pretrained={weights}", "precision=fp32"])
    assert hyper(resolved.run) == (3e-5, 0.01, 7)
    assert resolved.ds_config["optimizer"]["params"]["lr"] == 3e-5
    line = provenance.describe(resolved.run, provenance.provenance({}, resolved.json_fields))
    # its scheduler's other parameters are DeepSpeed's defaults (warmup_min_ratio 0); train.steps is the length
    assert line == ("adamw: lr 3e-05, weight decay 0.01 (your DeepSpeed JSON); betas (0.9, 0.999) (the fine-tuning "
                    "defaults of objective.kind=lm from a pretrained model; set optimizer.betas to change: "
                    "docs/fine-tuning.md); 7 warm-up steps, cosine decay to 0% of the peak by step 200 (your "
                    "DeepSpeed JSON)"), line
    assert resolved.ds_config["optimizer"]["params"]["betas"] == [0.9, 0.999]  # what the JSON leaves out
    # a --set wins over the JSON and says so
    resolved = resolved_with(user, [f"model.pretrained={weights}", "precision=fp32", "optimizer.lr=5e-5"])
    sources = field_sources(None, ["optimizer.lr=5e-5"])
    assert resolved.run.optimizer.lr == resolved.ds_config["optimizer"]["params"]["lr"] == 5e-5
    assert provenance.describe(resolved.run, provenance.provenance(sources, resolved.json_fields)).startswith(
        "adamw: lr 5e-05 (your --set); weight decay 0.01 (your DeepSpeed JSON); betas (0.9, 0.999) (the fine-tuning")


def test_a_json_that_leaves_the_rate_out_or_auto_gets_the_fine_tuning_default(weights):
    sets = [f"model.pretrained={weights}", "precision=fp32", "objective.kind=reward"]
    for user in ({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}},
                 {"train_micro_batch_size_per_gpu": 2}):
        resolved = resolved_with(user, sets)
        assert resolved.ds_config["optimizer"]["params"]["lr"] == 1e-4, user
        assert resolved.ds_config["optimizer"]["params"]["weight_decay"] == 0.0, user
        assert resolved.ds_config["scheduler"]["params"]["warmup_num_steps"] == 1, user
        assert "optimizer.lr" not in resolved.json_fields


@pytest.mark.parametrize("name", ["zero2", "zero3", "zero3_offload", "pipeline"])
def test_the_shipped_deepspeed_configs_fine_tune_at_the_fine_tuning_defaults(name, weights):
    """Written for pretraining, they leave the rate, weight decay, betas and warm-up "auto": the run's own."""
    shipped = json.loads((REPO / "ds_configs" / f"{name}.json").read_text())
    sets = [f"model.pretrained={weights}", "objective.kind=dpo", "precision=fp32"]
    sets += ["pipeline.stages=2", "objective.kind=lm"] if name == "pipeline" else []
    resolved = resolve(load_run_config(None, sets), shipped, 8, CPU, sources=field_sources(None, sets))
    expected = 2e-5 if name == "pipeline" else 1e-6
    assert resolved.ds_config["optimizer"]["params"]["lr"] == expected == resolved.run.optimizer.lr
    assert resolved.ds_config["optimizer"]["params"]["weight_decay"] == 0.0
    assert resolved.ds_config["scheduler"]["params"]["warmup_num_steps"] == 1
    assert resolved.ds_config["optimizer"]["params"]["betas"] == [0.9, 0.999]
    scratch = resolve(load_run_config(None, ["precision=fp32"]), shipped, 8, CPU)
    assert hyper(scratch.run) == (6e-4, 0.1, 20) and scratch.ds_config["optimizer"]["params"]["betas"] == [0.9, 0.95]


RECORDED = {"optimizer": {"lr": 6e-4, "weight_decay": 0.1, "betas": [0.9, 0.95]},
            "schedule": {"warmup_steps": 20, "kind": "cosine", "min_lr_ratio": 0.1}}


def test_a_resume_keeps_the_values_its_run_started_with(weights):
    """A run started by a version whose defaults were pretraining's resumes at its own rate, not today's."""
    run = load_run_config(None, [f"model.pretrained={weights}"])
    assert hyper(run) == (2e-5, 0.0, 0)
    kept, fields = provenance.keep_recorded(run, RECORDED, {})
    assert hyper(kept) == (6e-4, 0.1, 20) and set(fields) == {"optimizer.lr", "optimizer.weight_decay",
                                                               "optimizer.betas", "schedule.warmup_steps"}
    assert kept.optimizer.betas == (0.9, 0.95)  # a tuple, as the run config holds it (the record has a list)
    assert "lr 0.0006, weight decay 0.1, betas (0.9, 0.95), 20 warm-up steps (kept from the run it resumes)" in \
        provenance.describe(kept, provenance.provenance({}, frozenset(), fields))
    # what the user gives again wins; with the sources unknown, a value other than today's default counts as given
    run = load_run_config(None, [f"model.pretrained={weights}", "optimizer.lr=1e-5"])
    for sources in ({"optimizer.lr": "--set"}, None):
        kept, fields = provenance.keep_recorded(run, RECORDED, sources)
        assert hyper(kept) == (1e-5, 0.1, 20) and "optimizer.lr" not in fields


def test_estimate_recommends_a_command_that_says_what_it_trains_with(capsys):
    from bigtrain.cli import main
    assert main(["estimate", "--model", "gpt2", "--size", "tiny", "--gpu-mem", "80", "--set", "lora.r=4",
                 "--set", "objective.kind=dpo", "--set", "optimizer.weight_decay=0.01"]) == 0
    out = capsys.readouterr().out.splitlines()
    command = next(i for i, line in enumerate(out) if line.startswith("  bigtrain train "))
    assert "--set optimizer.weight_decay=0.01" in out[command]  # the user's own, carried into the command
    assert out[command + 1].startswith("  which trains with adamw: lr 0.0006 (the pretraining defaults: no "
                                       "model.pretrained, random weights; set optimizer.lr to change"), out


def tiny_llama(directory: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64)).save_pretrained(directory)
    return directory


def test_a_job_from_a_directory_says_its_fine_tuning_defaults_and_a_resume_keeps_them(one_rank_group, tmp_path,
                                                                                      caplog, monkeypatch):
    """The start line of a real job from a pretrained directory; then the objective's default changes (as between
    two versions) and --resume trains on at the rate the run started with, saying so."""
    from bigtrain.config.flags import build_run_parser, config_sources, run_config_from_args
    from bigtrain.distributed.world import World
    from bigtrain.objectives.base import FineTuning
    from bigtrain.train.job import train
    directory = tiny_llama(tmp_path / "llama")
    flags = ["--model", "hf", "--set", f"model.pretrained={directory}", "--data", "synthetic", "--out",
             str(tmp_path / "run"), "--set", "data.seq_len=32", "--set", "data.vocab_size=512", "--set",
             "precision=fp32", "--set", "train.sample_tokens=0", "--peak-tflops", "1", "--set",
             "logging.progress_bar=false", "--set", "train.eval_interval=0", "--set", "batch.global_batch=2",
             "--set", "batch.micro_batch=2"]

    def job(*more: str) -> tuple[dict, str]:
        args = build_run_parser().parse_args([*flags, *more])
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="bigtrain"):
            summary = train(run_config_from_args(args), World(0, 0, 1), resume=args.resume,
                            stop_after=args.stop_after, sources=config_sources(args))
        return summary, next(r.getMessage() for r in caplog.records if r.getMessage().startswith("adamw: "))

    summary, line = job("--steps", "3", "--stop-after", "1")
    assert summary["run_config"]["optimizer"]["lr"] == summary["ds_config"]["optimizer"]["params"]["lr"] == 2e-5
    assert line.startswith("adamw: lr 2e-05, weight decay 0, betas (0.9, 0.999), no warm-up (the fine-tuning "
                           "defaults of objective.kind=lm from a pretrained model;"), line
    assert summary["ds_config"]["optimizer"]["params"]["betas"] == [0.9, 0.999]
    lm = OBJECTIVES["lm"]
    monkeypatch.setattr(lm, "fine_tuning", FineTuning(lr=5e-5, weight_decay=0.01, betas=(0.8, 0.99), warmup_steps=2))
    assert load_run_config(None, [f"model.pretrained={directory}"]).optimizer.lr == 5e-5  # today's default moved
    summary, line = job("--steps", "3", "--resume")
    assert summary["run_config"]["optimizer"]["lr"] == summary["ds_config"]["optimizer"]["params"]["lr"] == 2e-5
    assert summary["run_config"]["optimizer"]["weight_decay"] == 0.0
    assert line.startswith("adamw: lr 2e-05, weight decay 0, betas (0.9, 0.999), no warm-up (kept from the run it "
                           "resumes)"), line
    assert summary["ds_config"]["optimizer"]["params"]["betas"] == [0.9, 0.999]
    assert len(summary["losses"]) == 3


@pytest.mark.parametrize("kind", ["cosine", "constant"])
def test_no_warm_up_starts_at_the_peak(kind, weights):
    """A fine-tune warms up none, as TRL's trainers: DeepSpeed's own scheduler, built from the generated section,
    gives the peak rate at the first and second steps (it warms up over 2 at least), and the JSON reads back as the
    run config it came from."""
    import torch
    from deepspeed.runtime import lr_schedules

    from bigtrain.ds.generate import scheduler_section
    from bigtrain.ds.mapping import stated
    from bigtrain.train.engine import start_schedule
    run = load_run_config(None, [f"model.pretrained={weights}", "objective.kind=lm", f"schedule.kind={kind}",
                                 "train.steps=10"])
    section = scheduler_section(run.schedule, run.optimizer.lr, run.train.steps)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=run.optimizer.lr)
    scheduler = getattr(lr_schedules, section["type"])(optimizer, **section["params"])
    start_schedule(scheduler)
    rates = []
    for _ in range(run.train.steps):
        rates.append(optimizer.param_groups[0]["lr"] / run.optimizer.lr)
        optimizer.step()
        scheduler.step()
    assert rates[:2] == pytest.approx([1.0, 1.0])
    assert rates[-1] == pytest.approx(1.0 if kind == "constant" else run.schedule.min_lr_ratio)
    read = stated({"scheduler": section})
    assert read["schedule.warmup_steps"] == 0 and read.get("schedule.min_lr_ratio", 0.1) == run.schedule.min_lr_ratio


def test_a_linear_schedule_warms_up_one_step_and_refuses_none(weights):
    """DeepSpeed's WarmupDecayLR starts at its floor: the fine-tuning default becomes 1 step there, said as the
    default, and a warm-up of 0 given with it is one line."""
    run = load_run_config(None, [f"model.pretrained={weights}", "objective.kind=lm", "schedule.kind=linear"])
    assert run.schedule.warmup_steps == 1
    with pytest.raises(ValueError, match=r"schedule.warmup_steps=0 with schedule.kind=linear.*cosine or constant"):
        load_run_config(None, [f"model.pretrained={weights}", "objective.kind=lm", "schedule.kind=linear",
                               "schedule.warmup_steps=0"])
