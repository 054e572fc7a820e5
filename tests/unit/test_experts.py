"""Expert parallelism's rules, read from DeepSpeed (AutoEP's presets and validation), and bigtrain's fix for AutoEP
against transformers' output-capture registry."""
from __future__ import annotations

import pytest
import torch

from bigtrain.config.load import load_run_config
from bigtrain.ds.generate import build_ds_config
from bigtrain.ds.lint import DeviceCaps, errors, lint_problems
from bigtrain.parallel.experts import expert_problem, output_capture_lookups, to_transformers_names

GPU = DeviceCaps("cuda", fp16=True, bf16=True, local=False)


def test_parallel_expert_writes_deepspeeds_section_with_data_parallelism_over_every_rank():
    run = load_run_config(None, ["model.family=hf", "parallel.expert=2", "zero.stage=2", "batch.micro_batch=4"])
    ds = build_ds_config(run, 4)
    assert ds["expert_parallel"] == {"enabled": True, "autoep_size": 2}
    assert ds["train_batch_size"] == 16  # the dense weights are data-parallel over all 4 ranks


def test_a_model_autoep_has_no_preset_for_is_one_line():
    from transformers import LlamaConfig, MixtralConfig
    line = expert_problem(LlamaConfig(), 2)
    assert line.startswith("parallel.expert=2: DeepSpeed's AutoEP has no preset for model type 'llama'")
    assert "mixtral" in line and "qwen3_moe" in line
    assert expert_problem(MixtralConfig(num_local_experts=4), 2) is None
    assert "the model's 6 experts do not divide over 4 ranks" in expert_problem(MixtralConfig(num_local_experts=6), 4)
    with pytest.raises(ValueError, match="the llama family does not support expert parallelism"):
        from bigtrain.parallel.split_rules import check_family_modes
        from bigtrain.config.topology import Topology
        check_family_modes("llama", Topology(2, expert=2))


def test_lint_asks_deepspeeds_autoep_validation():
    base = {"train_batch_size": 8, "zero_optimization": {"stage": 2}}
    ok = {**base, "expert_parallel": {"enabled": True, "autoep_size": 2}}
    assert not errors(lint_problems(ok, GPU, 4))
    bad = {**base, "expert_parallel": {"enabled": True, "autoep_size": 2, "combine_impl": "fast"}}
    lines = [str(p) for p in errors(lint_problems(bad, GPU, 4))]
    assert lines == ["expert_parallel: DeepSpeed's AutoEP refuses it: combine_impl must be one of ('auto', "
                     "'weighted_sum', 'fused_weighted_sum', 'legacy_bmm'), got 'fast'"], lines
    odd = {**base, "expert_parallel": {"enabled": True, "autoep_size": 3}}
    assert [str(p) for p in errors(lint_problems(odd, GPU, 4))] == [
        "expert_parallel.autoep_size=3 needs a multiple of 3 ranks; checked for 4 rank(s)"]
    z3 = {**ok, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}
    assert any("AutoEP does not support hpZ" in str(p) for p in errors(lint_problems(z3, GPU, 4)))


def test_the_registry_fix_lasts_only_while_autoep_converts_and_a_second_model_is_untouched(tmp_path):
    """DeepSpeed's dict-style lookups work inside `output_capture_lookups` (what `deepspeed.initialize` runs in for an
    expert-parallel model, bigtrain.train.assemble); before it, after it and after building the expert-parallel
    split, transformers' registry is its own: a reference, reward model or teacher built in the same process (or
    the next job's model) runs as transformers made it."""
    from transformers import MixtralConfig, MixtralForCausalLM
    from transformers.utils import output_capturing

    from bigtrain.config.topology import Topology
    from bigtrain.models import build
    from bigtrain.parallel.split import ModelSplit
    registry = output_capturing._CAN_RECORD_REGISTRY
    own = type(registry).__dict__["get"]
    config = MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=2, num_local_experts=4)
    MixtralForCausalLM(config).save_pretrained(tmp_path / "mixtral")
    ModelSplit.for_job(build("hf", "custom", pretrained=str(tmp_path / "mixtral")), Topology(2, expert=2), rank=0)
    assert type(registry).__dict__["get"] is own  # building the split changes nothing of the process
    with output_capture_lookups() as needed:
        assert registry.get("<class 'no.Such'>", "default") == "default"  # DeepSpeed's call: a TypeError unpatched
        key = next(iter(registry), None)
        if key is not None:
            assert registry.get(key) == dict.get(registry, key)  # a class name finds its entry
    assert needed  # transformers 5.24's registry refuses a default: the fix was needed here
    assert type(registry).__dict__["get"] is own
    with pytest.raises(TypeError):
        registry.get("<class 'no.Such'>", "default")
    torch.manual_seed(0)
    second = MixtralForCausalLM(config)  # built after it, as a reference copy would be
    out = second(torch.tensor([[1, 2, 3]]), output_router_logits=True)
    assert len(out.router_logits) == 1 and out.router_logits[0].shape[-1] == 4


def test_autoeps_names_map_back_to_transformers():
    """A Mixtral block as AutoEP holds it -> the names, fused gate/up layout and orientation transformers builds."""
    from transformers import MixtralConfig, MixtralForCausalLM
    config = MixtralConfig(vocab_size=32, hidden_size=8, intermediate_size=6, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=2, num_local_experts=4)
    torch.manual_seed(0)
    model = MixtralForCausalLM(config)
    hf = dict(model.state_dict())
    block = "model.layers.0.mlp"
    gate_up, down = hf[f"{block}.experts.gate_up_proj"], hf[f"{block}.experts.down_proj"]
    layout = gate_up.shape[1] == 2 * 6  # [E, 2F, H] as DeepSpeed's repack reads it
    ffn = (gate_up if layout else gate_up.transpose(1, 2))
    autoep = {k: v for k, v in hf.items() if not k.startswith(block)}
    autoep.update({f"{block}.experts.w1": ffn[:, :6], f"{block}.experts.w3": ffn[:, 6:],
                   f"{block}.experts.w2": down if layout else down.transpose(1, 2),
                   f"{block}.router.gate.weight": hf[f"{block}.gate.weight"],
                   f"{block}.gate.gate.weight": hf[f"{block}.gate.weight"]})  # AutoEP's alias of the router
    shapes = {k: tuple(v.shape) for k, v in hf.items()}
    back = to_transformers_names(autoep, config, shapes)
    assert sorted(back) == sorted(hf)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_lora_with_expert_parallelism_is_one_line():
    with pytest.raises(ValueError, match="lora.r=8 with parallel.expert=2: DeepSpeed's AutoEP repacks the experts"):
        load_run_config(None, ["model.family=hf", "lora.r=8", "parallel.expert=2"])


def test_the_estimator_spreads_the_experts_over_the_expert_ranks():
    from bigtrain.estimate.memory_model import ModelShape, Setup, estimate
    shape = ModelShape(family="hf", num_params=1000, n_layer=1, hidden=8, heads=2, seq_len=8, expert_params=600)
    one, two = (estimate(shape, Setup(world_size=2, zero_stage=1, precision="fp32", expert=e)) for e in (1, 2))
    assert one.params - two.params == 4 * 300  # the other rank's half of the experts, fp32
    assert one.optimizer == two.optimizer  # ZeRO partitions all states 1/2 either way
    assert "+ep2" in two.setup.label
    with pytest.raises(ValueError, match="parallel.expert=4 does not divide the 2 ranks"):
        Setup(world_size=2, expert=4)
