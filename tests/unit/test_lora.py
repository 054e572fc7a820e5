"""LoRA without a launcher: the `lora` section and its one-line errors, adapters put on a built model from outside
(frozen base, seeded adapters, the output head left alone, GPT-2's Conv1D), the optimizer's states counted on a
one-rank engine at ZeRO-1 and ZeRO-3, the merged and adapter exports against the trained model, and the memory
estimator's LoRA terms (2-rank training, resume and exports of real runs: tests/dist/test_lora_training.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bigtrain.config.load import load_run_config
from bigtrain.config.run_config import LoraConfig
from bigtrain.models import build
from bigtrain.parallel.lora import apply_lora, check_same_lora, saved_lora
from local_lora import make_base_dirs
from messages import naming

R = 4


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    return make_base_dirs(tmp_path_factory.mktemp("bases"))


@pytest.mark.parametrize("setting, named", [
    ("lora.r=-1", "lora.r=-1"), ("lora.alpha=0", "lora.alpha=0"), ("lora.dropout=1", "lora.dropout=1"),
    ("lora.targets=[]", "lora.targets=[]"), ("lora.rank=8", "lora.rank"), ("lora.r=two", "lora.r='two'")])
def test_a_wrong_lora_setting_is_one_line_naming_the_field(setting, named):
    with pytest.raises(ValueError) as err:
        load_run_config(None, [setting])
    assert len(str(err.value).splitlines()) == 1 and named in str(err.value), err.value


def test_lora_settings_parse_from_set_and_yaml(tmp_path):
    assert load_run_config(None, ["lora.r=16"]).lora == LoraConfig(r=16, alpha=16.0, dropout=0.0, targets="all-linear")
    assert load_run_config(None, ["lora.targets=q_proj,v_proj"]).lora.targets == ["q_proj", "v_proj"]
    (tmp_path / "run.yaml").write_text("lora: {r: 8, alpha: 32, dropout: 0.05, targets: [q_proj, o_proj]}\n")
    lora = load_run_config(tmp_path / "run.yaml").lora
    assert (lora.r, lora.alpha, lora.dropout, lora.targets) == (8, 32.0, 0.05, ["q_proj", "o_proj"])


@pytest.mark.parametrize("other, named", [("pipeline.stages=2", "pipeline.stages=1"),
                                          ("parallel.tensor=2", "parallel.tensor=1")])
def test_lora_with_pipeline_or_tensor_parallelism_is_refused_in_one_line(other, named):
    with pytest.raises(ValueError) as err:
        load_run_config(None, ["lora.r=8", other])
    assert len(str(err.value).splitlines()) == 1 and naming(str(err.value), "lora.r=8", named)


def adapted_llama(seed: int = 0, **lora: object):
    spec = build("llama", "tiny", vocab_size=256, seq_len=32)
    model = spec.build(seed=1)
    return spec, model, apply_lora(model, spec, LoraConfig(r=R, **lora), seed)


def test_adapters_go_on_every_linear_layer_but_the_head_and_only_they_train():
    spec, model, counts = adapted_llama()
    base = spec.build(seed=1)
    linears = {n: m for n, m in base.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    assert counts.layers == len(linears) == 14
    assert counts.trainable == sum(R * (m.in_features + m.out_features) for m in linears.values())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.lora_{ab}.default.weight" for n in linears for ab in "AB"}
    assert type(model.lm_head) is torch.nn.Linear and type(model) is type(base)  # the head and the class stay
    with torch.no_grad():  # B starts at zero: the adapted model is the base model until it trains
        ids = torch.randint(0, 256, (2, 16))
        assert torch.equal(model(ids).logits, base(ids).logits)
    assert "LoRA r=4 on 14 layers" in counts.line and f"{counts.trainable:,} trainable" in counts.line


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_lora_step_counts_no_weight_gradient_for_the_frozen_base(family):
    """TFLOP/s and MFU of a LoRA run: 4 FLOPs per frozen matmul weight and token (forward, input gradient), 6 per
    adapter parameter, the attention term as before; the frozen weights are the N of the family's 6N."""
    from bigtrain.models.hf_common import matmul_params
    from bigtrain.parallel.lora import training_flops
    spec = build(family, "tiny", vocab_size=256, seq_len=32)
    model = spec.build(seed=1)
    n = matmul_params(model)
    counts = apply_lora(model, spec, LoraConfig(r=R), 0)
    assert counts.frozen_matmul == n
    assert training_flops(spec, counts) == pytest.approx(spec.flops_per_sample - 32 * (2 * n - 6 * counts.trainable))


def test_adapters_are_seeded_the_same_on_every_build():
    one, two, other = (dict(adapted_llama(seed)[1].named_parameters()) for seed in (7, 7, 8))
    names = [n for n in one if ".lora_A." in n]
    assert all(torch.equal(one[n], two[n]) for n in names)
    assert not all(torch.equal(one[n], other[n]) for n in names)


def test_named_targets_and_gpt2s_conv1d_layers():
    _, model, counts = adapted_llama(targets=["q_proj", "v_proj"])
    assert counts.layers == 4 and all(type(m).__name__ == "Linear" for n, m in model.named_modules()
                                      if n.endswith(("k_proj", "o_proj", "up_proj")))
    spec = build("gpt2", "tiny", vocab_size=256, seq_len=32)
    gpt2 = spec.build(seed=1)
    counts = apply_lora(gpt2, spec, LoraConfig(r=R), 0)
    assert counts.layers == 8  # c_attn, c_proj, c_fc, mlp c_proj of 2 blocks
    assert gpt2.transformer.h[0].attn.c_attn.fan_in_fan_out  # Conv1D stores (in, out)


@pytest.mark.parametrize("lora, named", [({"targets": ["query"]}, "q_proj"), ({"targets": ["lm_head"]}, "head")])
def test_targets_that_miss_or_name_the_head_are_one_line(lora, named):
    with pytest.raises(ValueError) as err:
        adapted_llama(**lora)
    assert len(str(err.value).splitlines()) == 1 and naming(str(err.value), "lora.targets", named), err.value


@pytest.mark.parametrize("family, size", [("encoder", "tiny"), ("resnet", "tiny")])
def test_families_lora_does_not_serve_are_one_line(family, size):
    spec = build(family, size)
    with pytest.raises(ValueError) as err:
        apply_lora(spec.build(seed=1), spec, LoraConfig(r=R), 0)
    assert len(str(err.value).splitlines()) == 1 and naming(str(err.value), "lora.r=4", family, "lora.r=0")


def test_a_resume_with_other_adapters_is_one_line(tmp_path):
    saved = {"lora": {"r": 8, "alpha": 16.0, "dropout": 0.0, "targets": "all-linear"}}
    check_same_lora(tmp_path, saved, LoraConfig(r=8, dropout=0.1))  # dropout does not change the tensors
    assert saved_lora({"lora": {"r": 0}}) is None and saved_lora({}) is None
    for wanted, named in ((LoraConfig(r=4), "lora.r=4"), (None, "lora.r=0")):
        with pytest.raises(ValueError) as err:
            check_same_lora(tmp_path, saved, wanted)
        assert len(str(err.value).splitlines()) == 1 and naming(str(err.value), "--resume", "lora.r=8", named)


@pytest.mark.parametrize("stage", [1, 3])
def test_only_the_adapters_have_optimizer_states(one_rank_group, request, stage):
    """A real engine on one rank: Adam's moments and the fp32 masters exist for the adapters alone; after two
    steps the adapters moved and no base weight did."""
    import deepspeed
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from bigtrain.ds.resolve import resolve
    from bigtrain.train.engine import Engine, EngineOptions
    run = load_run_config(None, ["model.family=llama", "model.size=tiny", "precision=fp32", f"zero.stage={stage}",
                                 "lora.r=4", "batch.micro_batch=2", "batch.global_batch=2", "optimizer.lr=0.01",
                                 "schedule.kind=constant", "optimizer.torch_adam=true"])
    spec = build("llama", "tiny", vocab_size=256, seq_len=32)
    engine = Engine(spec, resolve(run, None, 1).ds_config, EngineOptions(seed=1, lora=run.lora))
    request.addfinalizer(unset_hf_deepspeed_config)  # a live ZeRO-3 model leaves transformers' switch on
    before = {n: p.clone() for n, p in spec.build(seed=1).named_parameters()}
    gen = torch.Generator().manual_seed(0)
    batches = iter([{"input_ids": (ids := torch.randint(0, 256, (2, 32), generator=gen)), "labels": ids}] * 2)
    for _ in range(2):
        engine.train_step(batches)
    states = engine.optimizer.optimizer.state.values()
    moments = sum(s["exp_avg"].numel() + s["exp_avg_sq"].numel() for s in states)
    masters = engine.optimizer.fp32_partitioned_groups_flat if stage == 3 else \
        engine.optimizer.single_partition_of_fp32_groups
    assert moments == 2 * engine.lora.trainable and sum(t.numel() for t in masters) == engine.lora.trainable
    with deepspeed.zero.GatheredParameters(list(engine.module().parameters()), enabled=stage == 3):
        now = {n.replace(".base_layer.", "."): p.detach().clone() for n, p in engine.module().named_parameters()}
    assert all(torch.equal(now[n], before[n]) for n in before), "a base weight changed"
    assert all(float(p.abs().max()) > 0 for n, p in now.items() if ".lora_B." in n)  # B left zero: they trained


def trained_tensors(spec, seed: int = 3) -> dict[str, torch.Tensor]:
    """A LoRA model's state as a checkpoint consolidates it: the base from its directory, adapters moved."""
    model = spec.build(seed=1)
    apply_lora(model, spec, LoraConfig(r=R), 0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


@pytest.mark.parametrize("base", ["llama", "gpt2"])
def test_merged_and_adapter_exports_give_the_trained_models_logits(bases, tmp_path, base):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from bigtrain.export.lora import trained_model, write_lora
    from bigtrain.export.verify import fixed_logits
    spec = build("hf", "custom", pretrained=str(bases[base]), seq_len=32)
    tensors = trained_tensors(spec)
    merged = write_lora(_fresh(tmp_path / "merged"), spec, tensors, LoraConfig(r=R))
    adapter = write_lora(_fresh(tmp_path / "adapter"), spec, tensors, LoraConfig(r=R), adapter_only=True)
    assert merged.format == "huggingface" and merged.max_logit_diff <= 1e-5
    assert adapter.format == "peft-adapter" and adapter.max_logit_diff <= 1e-6
    assert {p.name for p in (tmp_path / "adapter").iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        str(bases[base].resolve())
    trained = fixed_logits(trained_model(spec, tensors, LoraConfig(r=R)), spec)
    on_base = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(bases[base]), tmp_path / "adapter")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert float((fixed_logits(on_base, spec) - trained).abs().max()) <= 1e-6
    assert float((fixed_logits(plain, spec) - trained).abs().max()) <= 1e-5
    assert float((fixed_logits(AutoModelForCausalLM.from_pretrained(bases[base]), spec) - trained).abs().max()) > 1e-3


def test_adapter_export_needs_adapters_and_a_base_on_disk(tmp_path):
    from bigtrain.export.lora import check_adapter_export
    for spec, lora, named in ((build("llama", "tiny"), None, "lora.r=0"),
                              (build("llama", "tiny"), LoraConfig(r=R), "random weights")):
        with pytest.raises(ValueError) as err:
            check_adapter_export(spec, lora, tmp_path)
        assert len(str(err.value).splitlines()) == 1 and naming(str(err.value), "--adapter", named)


def _fresh(path: Path) -> Path:
    path.mkdir()
    return path
