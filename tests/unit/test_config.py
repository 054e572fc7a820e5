"""Typed run config: loading, dotted overrides, and the errors a user sees."""
import json

import pytest

from bigtrain.ds.batch import rescale_for_world, solve_batch
from bigtrain.config.run_config import RunConfig
from bigtrain.config.load import load_run_config, to_dict


def test_defaults_are_the_demo_run():
    run = RunConfig()
    assert (run.model.family, run.model.size, run.data.source) == ("gpt2", "mini", "builtin")
    assert run.zero.stage == 1 and run.precision == "auto"


def test_yaml_file_and_dotted_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("zero:\n  stage: 2\noptimizer:\n  lr: 1e-3\n  betas: [0.8, 0.9]\nmodel:\n  size: tiny\n")
    run = load_run_config(path, ["zero.stage=3", "offload.optimizer=cpu", "model.overrides.n_layer=3",
                                 "batch.global_batch=64", "checkpoint.dir=null"])
    assert run.zero.stage == 3 and run.offload.optimizer == "cpu"
    assert run.optimizer.lr == 1e-3 and run.optimizer.betas == (0.8, 0.9)
    assert run.model.overrides == {"n_layer": 3} and run.batch.global_batch == 64


def test_json_file_round_trip(tmp_path):
    run = RunConfig()
    path = tmp_path / "run.json"
    path.write_text(json.dumps(to_dict(run)))
    assert load_run_config(path) == run


@pytest.mark.parametrize("override, message", [
    (["zero.stag=3"], "unknown key 'zero.stag': did you mean 'stage'?"),
    (["zeros.stage=3"], "unknown key 'zeros': did you mean 'zero'?"),
    (["zero.stage=4"], "zero.stage=4: allowed values are 0, 1, 2, 3"),
    (["precision=fp8"], "precision='fp8': allowed values are auto, fp32, bf16, fp16"),
    (["offload.optimizer=gpu"], "offload.optimizer='gpu': allowed values are none, cpu, nvme"),
    (["optimizer.lr=fast"], "optimizer.lr='fast': expected a number"),
    (["train.steps=2.5"], "train.steps=2.5: expected an integer"),
    (["logging.csv=maybe"], "logging.csv='maybe': expected true or false"),
    (["optimizer.betas=[0.9]"], "optimizer.betas=[0.9]: expected a list of 2 values"),
    (["batch.micro_batch=0"], "batch.micro_batch=0: must be a positive integer"),
    (["zero.stage"], "expected KEY=VALUE"),
    (["zero.max_reuse_distance=-1"], "zero.max_reuse_distance=-1: must be >= 0"),
    (["zero.sub_group_size=0"], "zero.sub_group_size=0: must be > 0"),
    (["zero.stage=2", "pipeline.stages=2"], "DeepSpeed pipelines support ZeRO 0-1 only"),
    (["offload.param=cpu"], "offload.param=cpu needs stage 3 (got stage 1)"),
    (["zero.stage=2", "offload.optimizer=nvme"], "offload.optimizer=nvme needs stage 3 (ZeRO-Infinity)"),
])
def test_bad_values_name_the_field(override, message):
    with pytest.raises(ValueError) as err:
        load_run_config(None, override)
    assert message in str(err.value)


def test_bad_files(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(ValueError, match="is empty"):
        load_run_config(empty)
    with pytest.raises(ValueError, match="does not exist"):
        load_run_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_run_config(bad)


@pytest.mark.parametrize("given, dp, expected", [
    ((None, None, None), 2, (8, 4, 1)),
    ((64, None, None), 2, (64, 4, 8)),
    ((None, 2, 3), 4, (24, 2, 3)),
    ((32, 4, None), 2, (32, 4, 4)),
    ((32, None, 2), 2, (32, 8, 2)),
    ((12, 2, 3), 2, (12, 2, 3)),
])
def test_batch_solver(given, dp, expected):
    t = solve_batch(*given, dp)
    assert (t.global_batch, t.micro_batch, t.grad_accum) == expected
    assert t.global_batch == t.micro_batch * t.grad_accum * dp


def test_batch_solver_errors():
    with pytest.raises(ValueError, match=r"train_batch_size 10 != micro 2 x accum 2 x data-parallel 2 \(= 8\)"):
        solve_batch(10, 2, 2, 2)
    with pytest.raises(ValueError, match="not divisible"):
        solve_batch(30, 4, None, 2)


def test_rescale_keeps_global_batch_when_it_can():
    t = solve_batch(32, 4, 1, 8)
    new, note = rescale_for_world(t, 2)
    assert (new.global_batch, new.micro_batch, new.grad_accum) == (32, 4, 4) and "was 8" in note
    new, note = rescale_for_world(t, 3)  # 32 is not a multiple of 4 x 3
    assert (new.global_batch, new.micro_batch, new.grad_accum) == (12, 4, 1) and "changed the global batch" in note


def test_a_number_given_for_a_name_reads_as_that_name():
    run = load_run_config(None, ["model.family=resnet", "model.size=50"])
    assert run.model.size == "50"
    with pytest.raises(ValueError, match="model.size=True: expected a string"):
        load_run_config(None, ["model.size=true"])


def test_field_sources_name_what_the_user_gave(tmp_path):
    """The DeepSpeed JSON's precedence needs to know which fields came from --set and which from --config."""
    from bigtrain.config.load import field_sources
    path = tmp_path / "run.yaml"
    path.write_text("zero:\n  stage: 3\noptimizer: {lr: 3.0e-4}\nprecision: bf16\nmodel: {overrides: {n_layer: 2}}\n")
    assert field_sources(path, ["zero.stage=2", "model.overrides.n_embd=64", "train.steps=5"]) == {
        "zero.stage": "--set", "optimizer.lr": "--config", "precision": "--config", "model.overrides": "--set",
        "train.steps": "--set"}
    assert field_sources(None, []) == {}


def test_flags_and_settings_deepspeed_would_refuse_on_the_ranks_are_one_line_first():
    """A negative warm-up, and 0 with the linear schedule (DeepSpeed's WarmupDecayLR starts at its floor), are one
    line (0 reached the ranks and failed there ~50 s later before 0 meant no warm-up); --stop-after 0 trained a
    step."""
    from bigtrain.config.flags import build_run_parser, run_config_from_args
    with pytest.raises(ValueError, match=r"schedule.warmup_steps=-1: must be >= 0"):
        load_run_config(None, ["schedule.warmup_steps=-1"])
    with pytest.raises(ValueError, match=r"schedule.warmup_steps=0 with schedule.kind=linear"):
        load_run_config(None, ["schedule.warmup_steps=0", "schedule.kind=linear"])
    with pytest.raises(ValueError, match=r"--stop-after 0: must be >= 1"):
        run_config_from_args(build_run_parser().parse_args(["--stop-after", "0"]))
