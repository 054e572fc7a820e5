"""Muon and ZeRO++ as run-config fields and JSON keys: generated, read back, linted by DeepSpeed's rules, and
refused in one line where DeepSpeed would refuse or silently ignore them."""
from __future__ import annotations

import pytest

from bigtrain.config.load import load_run_config
from bigtrain.ds.lint import DeviceCaps, errors, lint_problems, warnings
from bigtrain.ds.resolve import absorb, resolve

CPU = DeviceCaps("cpu", fp16=False, bf16=True, local=False)
GPU = DeviceCaps("cuda", fp16=True, bf16=True, local=False)
MUON = ["model.family=llama", "optimizer.name=muon", "precision=fp32"]


def lint(config: dict, device: DeviceCaps = CPU, world: int | None = 2) -> tuple[list[str], list[str]]:
    problems = lint_problems(config, device, world)
    return [str(p) for p in errors(problems)], [str(p) for p in warnings(problems)]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_muon_is_deepspeeds_muon_with_its_own_rates(stage):
    run = load_run_config(None, [*MUON, f"zero.stage={stage}", "optimizer.muon_lr=0.03", "optimizer.momentum=0.9"])
    ds = resolve(run, None, 2, CPU).ds_config
    assert ds["optimizer"]["type"] == "Muon"
    params = ds["optimizer"]["params"]
    assert (params["muon_lr"], params["momentum"], params["lr"]) == (0.03, 0.9, run.optimizer.lr)
    assert params["torch_adam"] is True  # its Adam half: torch's on a CPU, no kernel build
    assert ds["scheduler"]["type"] == "WarmupCosineLR"
    assert ("reduce_scatter" in ds["zero_optimization"]) == (stage == 3)  # ZeRO-3 refuses Muon with it
    assert absorb(load_run_config(None, []), ds).optimizer.muon_lr == 0.03  # and reads back


@pytest.mark.parametrize("sets, said", [
    (["schedule.kind=linear"], "optimizer.name=muon with schedule.kind=linear"),
    (["zero.stage=0"], "optimizer.name=muon with zero.stage=0 and optimizer.grad_clip=1.0"),
    (["zero.stage=3", "zero.quantized_gradients=true"], "optimizer.name=muon with zero.quantized_gradients=true"),
    (["optimizer.momentum=1.0"], "optimizer.momentum=1.0: must be in [0, 1)"),
])
def test_muon_settings_deepspeed_would_train_otherwise_are_one_line(sets, said):
    with pytest.raises(ValueError) as err:
        load_run_config(None, [*MUON, *sets])
    assert said in str(err.value) and "\n" not in str(err.value)


def test_muon_at_zero0_without_clipping_is_fine():
    load_run_config(None, [*MUON, "zero.stage=0", "optimizer.grad_clip=0"])


def muon_json(**zero) -> dict:
    return {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1, **zero},
            "optimizer": {"type": "Muon", "params": {"lr": 1e-3, "muon_lr": 0.02, "momentum": 0.95}}}


def test_lint_reads_muons_parameters_from_deepspeed():
    config = muon_json()
    assert lint(config) == ([], [])
    config["optimizer"]["params"].update(muon_lR=0.1, ns_method="newton")
    errs, _ = lint(config)
    assert any("optimizer.params.muon_lR" in e and "did you mean 'muon_lr'" in e for e in errs), errs
    assert any("optimizer.params.ns_method=\"newton\"" in e and "gram, standard" in e for e in errs), errs


def test_lint_names_what_deepspeeds_zero3_refuses_with_muon():
    errs, _ = lint(muon_json(stage=3))
    assert any(e.startswith("zero_optimization.reduce_scatter=true (its default) with Muon") for e in errs), errs
    assert lint(muon_json(stage=3, reduce_scatter=False)) == ([], [])
    config = muon_json(stage=3, reduce_scatter=False)
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3}}
    assert any("scheduler.type=\"WarmupLR\" with Muon" in w for w in lint(config)[1])


def test_zero_plus_plus_fields_reach_the_json_at_stage_3_only():
    run = load_run_config(None, ["zero.stage=3", "zero.hpz_partition_size=2", "zero.quantized_weights=true"])
    from bigtrain.ds.generate import build_ds_config
    zero = build_ds_config(run, 4)["zero_optimization"]
    assert zero["zero_hpz_partition_size"] == 2 and zero["zero_quantized_weights"] is True
    assert "zero_quantized_gradients" not in zero  # unset fields stay out (the checked-in files are unchanged)
    assert absorb(load_run_config(None, []), build_ds_config(run, 4)).zero.quantized_weights is True
    with pytest.raises(ValueError, match="zero.quantized_gradients=true with zero.stage=2: ZeRO"):
        load_run_config(None, ["zero.stage=2", "zero.quantized_gradients=true"])


def test_lint_holds_zero_plus_plus_to_deepspeeds_rules():
    config = {"train_batch_size": 8, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}}
    errs, _ = lint(config, GPU, world=4)
    assert any("zero_hpz_partition_size=3 does not divide the 4 ranks" in e for e in errs), errs
    config["zero_optimization"].update(zero_hpz_partition_size=2, zero_quantized_weights=True,
                                       zero_quantized_gradients=True)
    assert lint(config, GPU, world=4) == ([], [])
    errs, _ = lint(config, CPU, world=4)  # the CPU accelerator has no quantizer kernel
    assert len(errs) == 2 and all("needs DeepSpeed's quantizer kernel (QuantizerBuilder)" in e for e in errs), errs
    config["zero_optimization"]["stage"] = 2
    _, warns = lint(config, GPU, world=4)
    assert len(warns) == 3 and all("DeepSpeed ignores it below" in w for w in warns), warns


def test_a_quantized_run_on_this_cpu_is_refused_before_any_rank_trains():
    run = load_run_config(None, ["zero.stage=3", "zero.quantized_weights=true"])
    with pytest.raises(ValueError, match="zero_optimization.zero_quantized_weights=true needs DeepSpeed's quantizer"):
        resolve(run, None, 2, CPU)
