"""Generated DeepSpeed configs: every combination parses in DeepSpeed, the triple holds, files are fresh."""
import itertools
from dataclasses import replace
from pathlib import Path

import pytest

from bigtrain.config.run_config import (ActivationCheckpointConfig, BatchConfig, OffloadConfig, PipelineConfig, RunConfig,
                             ZeroConfig)
from bigtrain.config.load import load_run_config
from bigtrain.ds.generate import build_ds_config
from bigtrain.ds.files import render_files, stale_files
from bigtrain.ds.lint import DeviceCaps, semantic_problems, unknown_keys, validate_with_deepspeed
from bigtrain.ds.resolve import absorb

REPO = Path(__file__).resolve().parents[1]
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
    with pytest.raises(ValueError, match="offload.param=cpu needs zero.stage=3"):
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
