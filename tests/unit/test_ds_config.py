"""Generated DeepSpeed configs: every combination parses in DeepSpeed, the triple holds, files are fresh."""
import itertools
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from messages import naming

from bigtrain.config.run_config import (ActivationCheckpointConfig, BatchConfig, OffloadConfig, PipelineConfig, RunConfig,
                             ZeroConfig)
from bigtrain.config.load import load_run_config
from bigtrain.ds.generate import build_ds_config
from bigtrain.ds.files import render_files, stale_files
from bigtrain.ds.lint import DeviceCaps, semantic_problems, unknown_keys, validate_with_deepspeed
from bigtrain.ds.resolve import absorb

REPO = Path(__file__).resolve().parents[2]
GPU = DeviceCaps("cuda", fp16=True, bf16=True)


def combinations():
    for stage, (opt_off, param_off), precision, stages, ac in itertools.product(
            (0, 1, 2, 3), (("none", "none"), ("cpu", "none"), ("cpu", "cpu"), ("nvme", "nvme")),
            ("fp32", "bf16", "fp16"), (1, 2), (False, True)):
        valid = not ((param_off != "none" and stage != 3) or (opt_off != "none" and stage == 0)
                     or (opt_off == "nvme" and stage != 3) or (stages > 1 and stage >= 2))
        if valid:
            yield stage, opt_off, param_off, precision, stages, ac


COMBOS = list(combinations())


def make_run(stage, opt_off, param_off, precision, stages, ac, tmp="/tmp"):
    return RunConfig(zero=ZeroConfig(stage=stage), precision=precision,
                     offload=OffloadConfig(optimizer=opt_off, param=param_off, nvme_path=tmp),
                     pipeline=PipelineConfig(stages=stages), batch=BatchConfig(micro_batch=2, grad_accum=2),
                     activation_checkpointing=ActivationCheckpointConfig(enabled=ac, every_n_layers=2))


def test_combination_count():
    assert len(COMBOS) == 72  # every stage x offload x precision x pipeline x checkpointing that DeepSpeed allows


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(map(str, c)))
def test_every_combination_is_accepted(combo, tmp_path):
    run = make_run(*combo, tmp=str(tmp_path))
    world = 4
    config = build_ds_config(run, world)
    dp = world // run.pipeline.stages
    assert config["train_batch_size"] == config["train_micro_batch_size_per_gpu"] * \
        config["gradient_accumulation_steps"] * dp
    assert unknown_keys(config) == []
    assert semantic_problems(config, world, None, GPU) == []
    assert validate_with_deepspeed(config, dp) == []
    back = absorb(RunConfig(), config)  # what the runner reads back agrees with what was generated
    assert (back.zero.stage, back.offload.optimizer, back.offload.param, back.precision, back.pipeline.stages,
            back.activation_checkpointing.enabled) == combo[:5] + (combo[5],)


def test_mismatched_combinations_are_refused():
    with pytest.raises(ValueError, match="pipelines support ZeRO 0-1"):
        make_run(2, "none", "none", "bf16", 2, False)
    with pytest.raises(ValueError, match=r"offload.param=cpu needs stage 3 \(got stage 2\)"):
        make_run(2, "cpu", "cpu", "bf16", 1, False)


@pytest.mark.parametrize("world", [1, 2, 3, 8, 16])
def test_triple_holds_at_any_world_size(world):
    run = replace(RunConfig(), batch=BatchConfig(micro_batch=3, grad_accum=2))
    config = build_ds_config(run, world)
    assert config["train_batch_size"] == 3 * 2 * world


def test_stage3_memory_knobs_reach_the_json():
    run = load_run_config(None, ["zero.stage=3", "zero.max_reuse_distance=0", "zero.sub_group_size=100000000"])
    section = build_ds_config(run, 2)["zero_optimization"]
    assert section["stage3_max_reuse_distance"] == 0 and section["sub_group_size"] == 100_000_000
    assert validate_with_deepspeed(build_ds_config(run, 2), 2) == []


def test_checked_in_files_match_generation():
    assert stale_files(REPO / "ds_configs") == [], "run `bigtrain configs --out ds_configs` and commit"
    names = set(render_files())
    for required in ("zero0", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload", "zero3_nvme", "pipeline"):
        assert f"{required}.json" in names
    assert "| `zero3_nvme.json` |" in render_files()["README.md"]


# --- one resolution path: the run config, a user's JSON, the world size, the device -----------------

CPU = DeviceCaps("cpu", fp16=False, bf16=True)
NO_OPTIMIZER = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}


def resolve_with(json_dict, sets=(), config=None, world=2, **kwargs):
    from bigtrain.config.load import field_sources
    from bigtrain.ds.resolve import resolve
    run = load_run_config(config, list(sets))
    return resolve(run, json_dict, world, CPU, sources=field_sources(config, list(sets)), **kwargs)


def test_a_json_without_optimizer_gets_the_run_configs_sections_each_named_once():
    resolved = resolve_with(NO_OPTIMIZER, ["precision=fp32", "optimizer.lr=3e-4"])
    ds = resolved.ds_config
    assert ds["optimizer"]["type"] == "AdamW" and ds["optimizer"]["params"]["lr"] == 3e-4
    assert ds["scheduler"]["type"] == "WarmupCosineLR" and ds["gradient_clipping"] == 1.0
    assert ds["bf16"] == {"enabled": False} and ds["fp16"] == {"enabled": False}
    assert ds["zero_optimization"] == {"stage": 2}  # a section the JSON has is DeepSpeed's to complete
    filled = [n.split(":")[0] for n in resolved.notes if n.startswith("filled from the run config")]
    sections = ("optimizer", "scheduler", "gradient_clipping", "precision")  # one note each, in this order
    assert len(filled) == len(sections) and all(s in note for s, note in zip(sections, filled)), filled
    assert (ds["train_batch_size"], ds["gradient_accumulation_steps"]) == (8, 1)
    assert validate_with_deepspeed(ds, 2) == []
    # DeepSpeed's defaults for what the zero section leaves out are what the run config records
    assert resolved.run.zero.stage == 2 and resolved.run.zero.reduce_bucket_size == 500_000_000


def test_set_wins_over_the_json_and_the_json_over_config_one_line_per_field(tmp_path):
    yaml = tmp_path / "run.yaml"
    yaml.write_text("zero:\n  stage: 3\noptimizer:\n  lr: 3.0e-4\n  weight_decay: 0.1\n")
    zero2 = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    assert zero2["optimizer"]["params"]["lr"] == "auto"  # the shipped file leaves the rate to the run config
    zero2["optimizer"]["params"]["lr"] = 6e-4  # a user's copy that states one
    resolved = resolve_with(zero2, ["optimizer.grad_clip=0.5", "zero.reduce_bucket_size=123"], config=yaml)
    assert resolved.ds_config["zero_optimization"]["stage"] == 2 and resolved.run.zero.stage == 2
    assert resolved.ds_config["optimizer"]["params"]["lr"] == 6e-4 and resolved.run.optimizer.lr == 6e-4
    assert resolved.ds_config["gradient_clipping"] == 0.5 and resolved.run.optimizer.grad_clip == 0.5
    assert resolved.ds_config["zero_optimization"]["reduce_bucket_size"] == 123
    lines = [n for n in resolved.notes if n.startswith("precedence: ")]
    # one line per field: what each source gives, and which wins (weight_decay agrees (0.1): no line)
    fields = [("zero.stage:", "JSON gives 2", "--config 3", "JSON wins"),
              ("zero.reduce_bucket_size:", "--set gives 123", "JSON 50000000", "--set wins"),
              ("optimizer.lr:", "JSON gives 0.0006", "--config 0.0003", "JSON wins"),
              ("optimizer.grad_clip:", "--set gives 0.5", "JSON 1.0", "--set wins")]
    assert len(lines) == len(fields) and all(naming(lines, *needles) for needles in fields), lines


def test_the_record_is_exactly_what_ran():
    user = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 123,
                                  "offload_optimizer": {"device": "cpu", "pin_memory": False}}}
    resolved = resolve_with(user, ["precision=fp32"])
    assert resolved.run.offload.pin_memory is False and resolved.run.offload.optimizer == "cpu"
    assert resolved.run.zero.reduce_bucket_size == 123 and resolved.run.zero.overlap_comm is False
    assert resolved.ds_config["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    back = absorb(RunConfig(), resolved.ds_config)  # reading the dict that ran gives the same run config
    assert back == resolved.run


@pytest.mark.parametrize("sets, expected, why", [
    ([], (8, 2, 4), "(kept)"),
    (["batch.global_batch=4"], (4, 2, 2), "(batch.global_batch given by --set)"),
])
def test_resume_at_another_world_size_keeps_the_checkpoints_global_batch(sets, expected, why):
    """Saved at 2 ranks with micro 2 x accum 2 (global 8), resumed at 1 rank: accumulation refitted."""
    user = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1}}
    resolved = resolve_with(user, ["precision=fp32", *sets], world=1, resume_batch=8)
    ds = resolved.ds_config
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == expected
    g, m, a = expected
    assert naming(resolved.notes, "global batch", "checkpoint trained with 8", f"{g} {why}", f"train_batch_size {g}",
                  f"micro {m}", f"accum {a}", "data-parallel 1"), resolved.notes


def test_a_shipped_json_is_fitted_to_any_world_size():
    zero2 = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    for world, accum in ((1, 8), (2, 4), (8, 1)):
        ds = resolve_with(zero2, ["precision=fp32"], world=world).ds_config
        assert (ds["train_batch_size"], ds["gradient_accumulation_steps"]) == (32, accum)


def test_hf_auto_offload_and_batch_take_the_run_configs_values():
    hf = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
          "zero_optimization": {"stage": "auto", "offload_optimizer": {"device": "auto"}}}
    resolved = resolve_with(hf, ["zero.stage=2", "offload.optimizer=cpu", "batch.micro_batch=2", "precision=fp32"])
    zero = resolved.ds_config["zero_optimization"]
    assert zero["stage"] == 2 and zero["offload_optimizer"]["device"] == "cpu"
    assert resolved.ds_config["train_batch_size"] == 4 and resolved.run.offload.optimizer == "cpu"


def test_the_cross_field_rules_exist_once():
    """The run config, the JSON lint, the benchmark cases and the estimator say each rule in the same words."""
    from bigtrain.bench.cases import Strategy
    from bigtrain.config.rules import DS_KEYS, Layout, layout_problems
    from bigtrain.ds.lint import lint_problems
    from bigtrain.estimate.memory_model import Setup
    offload = "needs stage 3 (got stage 1): only ZeRO-3 partitions the parameters"
    for build in (lambda: make_run(1, "cpu", "cpu", "bf16", 1, False), lambda: Strategy(zero=1, offload="all"),
                  lambda: Setup(world_size=2, zero_stage=1, offload_optimizer="cpu", offload_param="cpu")):
        with pytest.raises(ValueError, match=re.escape(f"offload.param=cpu {offload}")):
            build()
    pipeline = "with 2 pipeline stages: DeepSpeed pipelines support ZeRO 0-1 only"
    for build in (lambda: make_run(2, "none", "none", "bf16", 2, False), lambda: Strategy(zero=2, pipeline=2)):
        with pytest.raises(ValueError, match=re.escape(f"zero.stage=2 {pipeline}")):
            build()
    lines = [str(p) for p in lint_problems({"train_batch_size": 8, "pipeline": {"stages": 2}, "zero_optimization": {
        "stage": 2, "offload_param": {"device": "cpu"}}}, GPU, 2)]
    assert any(f"zero_optimization.stage=2 {pipeline}" in line for line in lines), lines
    assert any(f"zero_optimization.offload_param needs stage 3 (got stage 2)" in line for line in lines), lines
    assert layout_problems(Layout(1, "cpu", "cpu"), DS_KEYS)[0].startswith(f"zero_optimization.offload_param {offload}")
