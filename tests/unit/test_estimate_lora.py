"""The memory estimator under LoRA (`bigtrain estimate --lora-r`, Setup.lora_r): the frozen base keeps its
parameter bytes, gradients and optimizer states shrink to the adapters', and the adapter count is the one
training reports (measured on a Llama shape: docs/benchmarks.md, "Fine-tuning with LoRA")."""
from __future__ import annotations

import pytest

from bigtrain.config.load import load_run_config
from bigtrain.config.run_config import LoraConfig
from bigtrain.estimate.shape import shape_from_spec
from bigtrain.estimate.memory_model import ModelShape, Setup, estimate, setup_from_run
from bigtrain.models import build
from bigtrain.parallel.lora import apply_lora

# A toy decoder: one linear layer 1000 -> 3000 (1000 + 3000 = 4000 per rank of adapter) in 1e9 parameters.
SHAPE = ModelShape("toy", int(1e9), n_layer=1, hidden=8, heads=1, seq_len=1, linear_dims=((1000, 3000),))
N = 8


@pytest.mark.parametrize("precision, stage", [("bf16", 0), ("bf16", 1), ("bf16", 2), ("bf16", 3), ("fp32", 3)])
def test_lora_keeps_the_base_and_trains_only_the_adapters(precision, stage):
    r, p = 16, 2 if precision == "bf16" else 4
    adapters = r * 4000
    full = estimate(SHAPE, Setup(world_size=N, zero_stage=stage, precision=precision, param_persistence_threshold=0))
    lora = estimate(SHAPE, Setup(world_size=N, zero_stage=stage, precision=precision, param_persistence_threshold=0,
                                 lora_r=r))
    psi = 1e9 + adapters
    assert lora.params == pytest.approx(p * psi / (N if stage == 3 else 1))  # the whole base, as before
    assert lora.grads == pytest.approx(p * adapters / (N if stage >= 2 else 1))
    k = 12  # fp32 master + Adam's moments (ZeRO >= 1 keeps a master in fp32 too)
    assert lora.optimizer == pytest.approx(k * adapters / (N if stage >= 1 else 1))
    assert lora.step_transient == pytest.approx(4 * adapters / (N if stage >= 1 else 1))
    assert lora.model_states < full.model_states and lora.params >= full.params


def test_adapters_small_enough_stay_whole_under_zero3():
    """ZeRO-3 keeps tensors under param_persistence_threshold whole on every rank: LoRA's A (r x in) and
    B (out x r) usually are."""
    setup = Setup(world_size=N, zero_stage=3, precision="bf16", lora_r=16, param_persistence_threshold=100_000)
    assert SHAPE.adapter_numels(16) == (16_000, 48_000) and SHAPE.persistent_params(100_000, 16) == 64_000
    assert estimate(SHAPE, setup).params == pytest.approx(2 * (1e9 + 64_000) / N + 2 * 64_000)


def test_offloaded_lora_sends_only_the_adapters_states_to_the_host():
    est = estimate(SHAPE, Setup(world_size=N, zero_stage=3, precision="bf16", offload_optimizer="cpu", lora_r=16,
                                param_persistence_threshold=0))
    assert est.optimizer == 0 and est.host == pytest.approx((12 + 4) * 64_000 / N)


def test_the_estimators_adapter_count_is_the_one_training_reports():
    for family in ("llama", "gpt2"):
        spec = build(family, "tiny", vocab_size=256, seq_len=32)
        counts = apply_lora(spec.build(seed=0), spec, LoraConfig(r=8), 0)
        assert sum(shape_from_spec(spec).adapter_numels(8)) == counts.trainable, family


def test_a_run_config_with_lora_estimates_with_it():
    run = load_run_config(None, ["lora.r=16", "zero.stage=3"])
    assert setup_from_run(run, world_size=4, gpus_per_node=4).lora_r == 16
    with pytest.raises(ValueError, match="names no linear layers"):
        estimate(ModelShape("toy", 1000, n_layer=1, hidden=8, heads=1, seq_len=1), Setup(world_size=1, lora_r=4))


def test_cli_prints_the_adapters_and_recommends_lora(capsys):
    from bigtrain.cli import main
    assert main(["estimate", "--model", "llama", "--size", "1b", "--num-gpus", "2", "--lora-r", "16",
                 "--gpu-mem", "24GiB"]) == 0
    out = capsys.readouterr().out
    assert "LoRA r=16: 11.27M adapter parameters train" in out and "--set lora.r=16" in out
