"""Local Hugging Face checkpoints: Llama, Qwen2 and Mistral decoders and a BERT classifier, each a
directory made here (tests/local_hf.py: a config with random weights, a tokenizer trained on Python's own
docs), and two architectures no other test names, Gemma2 (causal LM) and DeBERTa-v2 (classifier), whose
transformers classes have no sdpa attention.

What `--model hf` decides from a directory, the attention kernel (sdpa where the class has it, else the
architecture's default, one log line saying which) and a few training steps of the held-out ones, the
pipeline form of each decoder equal to the HF model (Mistral with a sliding window shorter than the
sequence), FLOPs against the counter, and the one-line messages for a wrong family, an unsupported
architecture and remote code. Training from these directories on 2 ranks: tests/dist/test_hf_models_training.py.
"""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from local_hf import DECODERS, SEQ, make_hf_dirs

from bigtrain.models import SequentialPipeline, build, call_module


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """{name: directory}: the three decoders (+ a config-only llama), a BERT classifier, a ViT, the data
    (tests/local_hf.py)."""
    return make_hf_dirs(tmp_path_factory.mktemp("hf_dirs"))


def test_hf_family_decides_task_shape_and_tokenizer_from_the_directory(hf_dirs):
    from transformers import BertForSequenceClassification, LlamaForCausalLM

    from bigtrain.train.inputs import default_tokenizer, model_modality
    from bigtrain.config.run_config import DataConfig, ModelConfig

    llama = build("hf", "custom", pretrained=str(hf_dirs["llama"]), seq_len=SEQ)
    assert (llama.hf_class, llama.modality, llama.eval_metric) == (LlamaForCausalLM, "text", "perplexity")
    assert llama.pretrained == str(hf_dirs["llama"]) and llama.tokens_per_sample == SEQ
    model = llama.build()
    assert llama.num_params == sum(p.numel() for p in model.parameters())
    saved = LlamaForCausalLM.from_pretrained(hf_dirs["llama"])
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), saved.state_dict().values()))
    named = build("llama", "custom", pretrained=str(hf_dirs["llama"]), seq_len=SEQ)  # --model llama, same dir
    assert named.num_params == llama.num_params and named.flops_per_sample == llama.flops_per_sample
    assert all(torch.equal(a, b) for a, b in zip(named.build().state_dict().values(), saved.state_dict().values()))
    with pytest.raises(ValueError, match="--model hf takes its shape from model.pretrained"):
        build("hf", "8b", pretrained=str(hf_dirs["llama"]))

    bert = build("hf", "custom", pretrained=str(hf_dirs["bert"]), num_classes=2, seq_len=SEQ)
    assert (bert.hf_class, bert.modality, bert.eval_metric) == (BertForSequenceClassification, "classify", "accuracy")
    head = bert.build(seed=1).classifier.weight
    assert head.shape == (2, 64) and torch.equal(head, bert.build(seed=1).classifier.weight)  # seeded fresh head

    run_model = ModelConfig(family="hf", pretrained=str(hf_dirs["bert"]))
    assert run_model.size == "custom" and model_modality(run_model) == "classify"
    assert default_tokenizer(DataConfig(), run_model) == str(hf_dirs["bert"].resolve())
    assert default_tokenizer(DataConfig(), ModelConfig(family="gpt2")) is None


def test_classification_data_infers_the_classes_and_masks_the_padding(hf_dirs, tmp_path):
    """data.num_classes unset: the 2 labels of the file make 2 classes; padded positions are masked."""
    from bigtrain.data import build_data

    bundle = build_data(str(hf_dirs["labels"]), "classify", seq_len=128, tokenizer=str(hf_dirs["bert"]),
                        num_classes=None, cache_dir=tmp_path / "cache", tokenizer_dir=tmp_path / "tok")
    assert bundle.num_classes == 2
    batch = bundle.train.take(list(range(32)))
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert torch.equal(ids == bundle.tokenizer.pad_token_id, mask == 0)
    assert 0 < int((mask == 0).sum()) and bool(mask[:, 0].all())


def test_a_decoder_classifier_reads_each_padded_text_where_transformers_reads_it_alone(hf_dirs, tmp_path):
    """A decoder's classification head reads a row at its last token that is not config.pad_token_id. A directory
    whose config.json names another pad than its tokenizer's (which the data pads with) is built with the
    tokenizer's, so that a padded training row classifies as its text alone does (the head read the
    last padding position, which no user's unpadded text has)."""
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    from bigtrain.data import build_data
    from bigtrain.models.registry import DataFacts, model_overrides
    from local_hf import decoder_config

    tok = AutoTokenizer.from_pretrained(hf_dirs["llama"])
    config = decoder_config("llama", len(tok))
    config.num_labels, config.pad_token_id = 2, tok.pad_token_id + 5  # a pad the data never pads with
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(tmp_path / "classifier")
    tok.save_pretrained(tmp_path / "classifier")
    bundle = build_data(str(hf_dirs["labels"]), "classify", seq_len=64, tokenizer=str(tmp_path / "classifier"),
                        num_classes=None, cache_dir=tmp_path / "cache", tokenizer_dir=tmp_path / "tok")
    facts = DataFacts(seq_len=64, vocab_size=bundle.vocab_size, num_classes=bundle.num_classes,
                      pad_token_id=bundle.tokenizer.pad_token_id)
    spec = build("hf", "custom", **model_overrides("hf", "custom", facts, str(tmp_path / "classifier"), {}, "cpu"))
    assert spec.modality == "classify" and spec.config.pad_token_id == tok.pad_token_id
    model = spec.build().eval()
    batch = bundle.val.take(list(range(8)))
    lengths = batch["attention_mask"].sum(-1)
    assert bool((lengths < 64).any())  # some rows are padded
    with torch.no_grad():
        padded = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        alone = torch.cat([model(input_ids=row[None, :n]).logits for row, n in zip(batch["input_ids"], lengths)])
    assert torch.allclose(padded, alone, atol=1e-5, rtol=0), (padded - alone).abs().max()


def test_config_only_directory_starts_from_seeded_random_weights(hf_dirs):
    spec = build("llama", "custom", pretrained=str(hf_dirs["config_only"]), seq_len=SEQ)
    assert spec.pretrained is None and spec.config.num_key_value_heads == 2
    assert torch.equal(spec.build(seed=3).lm_head.weight, spec.build(seed=3).lm_head.weight)
    note = build("hf", "custom", pretrained=str(hf_dirs["config_only"])).weights_note
    assert "has a config but no weights" in note and "starting from random weights" in note


@pytest.mark.parametrize("arch", DECODERS)
def test_pipeline_layers_of_a_pretrained_decoder_equal_the_hf_model(hf_dirs, arch):
    """The stages read their layers from the directory; positions, rotary cos/sin and the causal (for
    Mistral sliding-window) mask computed inside the stages give the HF model's logits and loss."""
    spec = build("hf", "custom", pretrained=str(hf_dirs[arch]), seq_len=SEQ)
    plain = spec.build().eval()
    pipe = SequentialPipeline(spec).eval()
    ids = torch.randint(0, spec.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = plain(ids).logits, pipe(ids)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert spec.pipeline_loss(got, ids).item() == pytest.approx(spec.loss(plain(ids), ids).item(), abs=1e-5)


def test_flops_of_any_causal_lm_match_the_counter(hf_dirs):
    """N from the module (biases included, the tied head once), attention from the config: 6N + 12*L*w*s."""
    spec = build("hf", "custom", pretrained=str(hf_dirs["qwen2"]), seq_len=SEQ)
    model = spec.build()
    ids = torch.randint(0, spec.config.vocab_size, (2, SEQ))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        spec.loss(call_module(model, ids), ids).backward()
    measured = counter.get_total_flops() / 2
    assert abs(spec.flops_per_sample - measured) / measured < 0.05, (spec.flops_per_sample, measured)


@pytest.mark.parametrize("family, directory, needles", [
    ("gpt2", "llama", ["'llama' model", "--model gpt2 builds 'gpt2'", "use --model llama"]),
    ("llama", "qwen2", ["'qwen2' model", "--model llama builds 'llama'", "use --model hf"]),
    ("hf", "vit", ["model_type 'vit'", "no causal-LM or sequence-classification head", "supported: causal LMs"]),
    ("hf", "remote", ["model_type 'mymodel'", "remote code is not allowed", "trust_remote_code=true"]),
])
def test_wrong_family_and_unsupported_architectures_are_one_line(hf_dirs, family, directory, needles):
    from bigtrain.config.run_config import ModelConfig
    from bigtrain.train.inputs import model_modality

    with pytest.raises(ValueError) as err:  # what every rank runs before it reads any data
        model_modality(ModelConfig(family=family, pretrained=str(hf_dirs[directory])))
    message = str(err.value)
    assert "\n" not in message and all(n in message for n in needles), message
    with pytest.raises(ValueError, match="--model hf needs a local Hugging Face directory"):
        build("hf", "custom")


@pytest.mark.parametrize("arch, kernel", [("llama", "sdpa"), ("gemma2", "eager"), ("deberta_v2", "eager")])
def test_attention_is_sdpa_where_the_class_has_it_else_the_architectures_default(hf_dirs, arch, kernel, caplog):
    """Gemma2 and DeBERTa-v2 failed at start (bigtrain asked every class for sdpa); now each builds with its
    default, says so in one log line, and a few optimizer steps on one batch lower its loss."""
    with caplog.at_level(logging.INFO, logger="bigtrain"):
        spec = build("hf", "custom", pretrained=str(hf_dirs[arch]), seq_len=SEQ)
    said = [r.getMessage() for r in caplog.records if "attention" in r.getMessage()]
    assert len(said) == 1 and f"attention {kernel} for {spec.hf_class.__name__}" in said[0], said
    assert ("no sdpa" in said[0]) == (kernel != "sdpa"), said
    model = spec.build(seed=0).train()
    assert spec.config._attn_implementation == model.config._attn_implementation == kernel
    ids = torch.randint(0, spec.config.vocab_size, (4, SEQ), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids if spec.modality == "text" else torch.tensor([0, 1, 0, 1])}
    inputs, labels = spec.batch_to_inputs(batch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(4):
        loss = spec.loss(call_module(model, inputs), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    from bigtrain.estimate.shape import shape_from_spec
    assert shape_from_spec(spec, "bf16").num_params == spec.num_params  # `bigtrain estimate` measures it too


def test_asking_for_sdpa_where_the_class_has_none_is_one_line(hf_dirs):
    with pytest.raises(ValueError) as err:
        build("hf", "custom", pretrained=str(hf_dirs["gemma2"]), attn_implementation="sdpa")
    message = str(err.value)
    assert "\n" not in message and "Gemma2ForCausalLM has no sdpa attention" in message, message
    assert "model.overrides.attn_implementation" in message and "eager" in message, message
    spec = build("hf", "custom", pretrained=str(hf_dirs["llama"]), seq_len=SEQ, attn_implementation="eager")
    assert spec.build().config._attn_implementation == "eager"  # an explicit choice is kept
