"""Local Hugging Face checkpoints: Llama, Qwen2 and Mistral decoders and a BERT classifier, each a
directory made here (a config with random weights, a tokenizer trained on Python's own docs), and two
architectures no other test names, Gemma2 (causal LM) and DeBERTa-v2 (classifier), whose transformers
classes have no sdpa attention.

Unit tier: what `--model hf` decides from a directory, the attention kernel (sdpa where the class has
it, else the architecture's default, one log line saying which) and a few training steps of the held-out
ones, the pipeline form of each decoder equal to the HF model (Mistral with a sliding window shorter than
the sequence), FLOPs against the counter, and the one-line messages for a wrong family, an unsupported
architecture and remote code.
Distributed tier (one 2-rank launch, tests/dist_scripts/hf_runs.py): each decoder trains under
ZeRO-3 from its directory, resumes on the same curve, and exports to a directory that
`from_pretrained` loads with the trained model's logits; the classifier trains on a 2-label
jsonl file and reports accuracy; a mismatched --model stops before training.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from launch import REPO, launch_jobs

from bigtrain.models import SequentialPipeline, build, call_module

DECODERS = ("llama", "qwen2", "mistral")
SEQ = 32
STEPS = 6


def _decoder_config(arch: str, vocab: int):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    shape = dict(vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    if arch == "llama":
        return LlamaConfig(**shape, tie_word_embeddings=False)
    if arch == "qwen2":  # biased q/k/v projections, tied embeddings
        return Qwen2Config(**shape, tie_word_embeddings=True)
    return MistralConfig(**shape, sliding_window=16)  # shorter than SEQ: the sliding mask matters


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """{name: directory}: the three decoders (+ a config-only llama), a BERT classifier, a ViT, the data."""
    from transformers import (AutoModelForCausalLM, BertConfig, BertForSequenceClassification, BertTokenizerFast,
                              ViTConfig)

    from bigtrain.data.builtin import builtin_classification, builtin_documents
    from bigtrain.data.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("hf_dirs")
    docs = builtin_documents()
    (root / "corpus.txt").write_text("".join(docs[:16]))
    tok = train_bpe(docs[:40], 320)
    dirs = {"corpus": root / "corpus.txt"}
    for i, arch in enumerate(DECODERS):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_config(_decoder_config(arch, len(tok)))
        model.save_pretrained(root / arch)
        tok.save_pretrained(root / arch)
        dirs[arch] = root / arch
    _decoder_config("llama", len(tok)).save_pretrained(root / "config_only")
    dirs["config_only"] = root / "config_only"

    texts, labels, _ = builtin_classification(2)
    with (root / "labels.jsonl").open("w") as f:
        for text, label in zip(texts, labels):
            f.write(json.dumps({"text": text[:300], "label": label}) + "\n")
    from tokenizers import BertWordPieceTokenizer
    wordpiece = BertWordPieceTokenizer(lowercase=True)
    wordpiece.train_from_iterator(texts, vocab_size=600, min_frequency=2)
    wordpiece.save_model(str(root))
    bert_tok = BertTokenizerFast(vocab_file=str(root / "vocab.txt"))
    # A 3-way head saved: the 2-label data gives a 2-way head, which starts fresh.
    bert = BertForSequenceClassification(BertConfig(vocab_size=len(bert_tok), hidden_size=64, num_hidden_layers=2,
                                                    num_attention_heads=2, intermediate_size=128,
                                                    max_position_embeddings=64, num_labels=3))
    bert.save_pretrained(root / "bert")
    bert_tok.save_pretrained(root / "bert")
    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(root / "vit")
    (root / "remote").mkdir()
    (root / "remote" / "config.json").write_text(json.dumps(
        {"model_type": "mymodel", "auto_map": {"AutoConfig": "modeling_mymodel.MyConfig"}}))
    dirs.update(labels=root / "labels.jsonl", bert=root / "bert", vit=root / "vit", remote=root / "remote")
    dirs.update(_held_out_dirs(root, tok))
    return dirs


def _held_out_dirs(root: Path, tok) -> dict[str, Path]:
    """Gemma2 (logit soft-capping: transformers gives it no sdpa) and a DeBERTa-v2 classifier (disentangled
    attention, no sdpa either), saved with random weights and the BPE trained above."""
    from transformers import (DebertaV2Config, DebertaV2ForSequenceClassification, Gemma2Config,
                              Gemma2ForCausalLM)

    torch.manual_seed(5)
    gemma = Gemma2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                         sliding_window=16, pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id,
                         eos_token_id=tok.eos_token_id)
    deberta = DebertaV2Config(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                              intermediate_size=128, max_position_embeddings=64, num_labels=2,
                              pad_token_id=tok.pad_token_id)
    made = {"gemma2": Gemma2ForCausalLM._from_config(gemma, attn_implementation="eager"),
            "deberta_v2": DebertaV2ForSequenceClassification._from_config(deberta, attn_implementation="eager")}
    for name, model in made.items():
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return {name: root / name for name in made}


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
    from bigtrain.estimate.cli import shape_from_spec
    assert shape_from_spec(spec, "bf16").num_params == spec.num_params  # `bigtrain estimate` measures it too


def test_asking_for_sdpa_where_the_class_has_none_is_one_line(hf_dirs):
    with pytest.raises(ValueError) as err:
        build("hf", "custom", pretrained=str(hf_dirs["gemma2"]), attn_implementation="sdpa")
    message = str(err.value)
    assert "\n" not in message and "Gemma2ForCausalLM has no sdpa attention" in message, message
    assert "model.overrides.attn_implementation" in message and "eager" in message, message
    spec = build("hf", "custom", pretrained=str(hf_dirs["llama"]), seq_len=SEQ, attn_implementation="eager")
    assert spec.build().config._attn_implementation == "eager"  # an explicit choice is kept


# -- distributed tier: one launch ---------------------------------------------------------------

COMMON = ["--set", "precision=fp32", "--set", "logging.progress_bar=false", "--set", "train.sample_tokens=0",
          "--peak-tflops", "1", "--set", "zero.stage=3", "--set", f"data.seq_len={SEQ}", "--set", "batch.micro_batch=2",
          "--set", "data.num_proc=1",
          "--set", "batch.global_batch=8", "--set", "schedule.kind=constant", "--set", "schedule.warmup_steps=1",
          "--set", "optimizer.lr=3e-3",
          "--set", "train.eval_interval=0", "--set", "train.eval_batches=0", "--set", "logging.interval=1"]


@pytest.fixture(scope="module")
def runs(hf_dirs, tmp_path_factory) -> tuple[Path, str]:
    """(ROOT, rank 0's log): every job of the distributed tier in one 2-rank launch."""
    root = tmp_path_factory.mktemp("hf_runs")
    data = ["--data", str(hf_dirs["corpus"])]
    jobs = []
    for arch in DECODERS:
        model = ["--model", "hf", "--set", f"model.pretrained={hf_dirs[arch]}", *data]
        jobs.append({"name": arch, "args": [*COMMON, *model, "--steps", str(STEPS), "--set", "checkpoint.interval=3"],
                     "logits": True})
        jobs.append({"name": f"{arch}_resumed", "args": [*COMMON, *model, "--steps", str(STEPS), "--resume"],
                     "resume_from": arch})
    jobs.append({"name": "bert", "args": [*COMMON, "--model", "hf", "--set", f"model.pretrained={hf_dirs['bert']}",
                                          "--data", str(hf_dirs["labels"]), "--steps", "10",
                                          "--set", "train.eval_batches=4"]})
    jobs.append({"name": "mismatch", "args": [*COMMON, "--model", "gpt2", "--set",
                                              f"model.pretrained={hf_dirs['llama']}", *data], "expect_error": True})
    return root, launch_jobs(root, jobs, script=REPO / "tests" / "dist_scripts" / "hf_runs.py")


def summary(root: Path, name: str) -> dict:
    return json.loads((root / name / "summary.json").read_text())


@pytest.mark.dist
@pytest.mark.parametrize("arch", DECODERS)
def test_decoder_directory_trains_under_zero3_and_resumes_on_the_same_curve(runs, arch):
    root, _ = runs
    full, resumed = summary(root, arch), summary(root, f"{arch}_resumed")
    assert full["ds_config"]["zero_optimization"]["stage"] == 3 and full["world_size"] == 2
    losses = full["losses"]
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.05, losses
    probe = json.loads((root / arch / "probe_rank0.json").read_text())
    assert probe["optimizer"] == "DeepSpeedZeroOptimizer_Stage3", probe
    again = resumed["losses"][3:]
    diff = max(abs(a - b) / b for a, b in zip(again, losses[3:]))
    print(f"{arch}: losses {[round(x, 4) for x in losses]}, resumed max relative difference {diff:.1e}")
    assert len(again) == STEPS - 3 and diff <= 1e-5


@pytest.mark.dist
@pytest.mark.parametrize("arch", DECODERS)
def test_export_reloads_with_the_trained_models_logits(runs, arch, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bigtrain.export import export_checkpoint

    root, _ = runs
    shard = "300KB" if arch == "llama" else "5GB"  # the llama export is split into several files
    result = export_checkpoint(root / arch, tmp_path / "hf", max_shard_size=shard)
    assert result.format == "huggingface" and result.max_logit_diff == 0.0
    files = set(result.files)
    assert "tokenizer.json" in files and "config.json" in files
    assert ("model.safetensors.index.json" in files) == (arch == "llama"), files
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == arch and config["architectures"][0].endswith("ForCausalLM")
    trained = torch.load(root / arch / "logits.pt")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    with torch.no_grad():
        logits = model(trained["input_ids"]).logits
    diff = (logits - trained["logits"]).abs().max().item()
    print(f"{arch} export: max |logit difference| to the trained ZeRO-3 engine {diff:.1e}")
    assert diff <= 1e-5
    assert len(AutoTokenizer.from_pretrained(tmp_path / "hf")) == config["vocab_size"]


@pytest.mark.dist
def test_classifier_directory_trains_on_two_labels_and_reports_accuracy(runs, tmp_path):
    """The directory has a 3-way head; the 2 labels of the data make a fresh 2-way one (first loss near
    ln 2, not ln 3). Accuracy, not perplexity, in the eval line, the monitors, summary.json; the export
    is a classifier directory that reloads with the same logits."""
    from bigtrain.export import export_checkpoint

    root, log = runs
    result = summary(root, "bert")
    assert result["model"]["family"] == "hf" and abs(result["losses"][0] - 0.693) < 0.1, result["losses"]
    seen = 4 * 2 * 2  # eval_batches x micro-batch x ranks
    accuracy = result["final_val_accuracy"]
    assert 0.0 <= accuracy <= 1.0 and abs(accuracy * seen - round(accuracy * seen)) < 1e-9
    assert result["val_accuracies"] == [[10, accuracy]]
    eval_line = next(line for line in log.splitlines() if line.startswith("eval step 10"))
    assert f"accuracy {accuracy:.4f}" in eval_line and "ppl" not in eval_line
    assert any("val_accuracy" in p.read_text() or "val_accuracy" in p.name for p in (root / "bert").rglob("*.csv"))
    exported = export_checkpoint(root / "bert", tmp_path / "hf")
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(tmp_path / "hf")
    assert config.architectures == ["BertForSequenceClassification"] and config.num_labels == 2
    assert exported.max_logit_diff == 0.0 and "tokenizer.json" in exported.files


@pytest.mark.dist
def test_mismatched_family_stops_before_training(runs):
    root, _ = runs
    message = (root / "mismatch" / "error.txt").read_text()
    assert "\n" not in message and "'llama' model" in message and "use --model llama" in message
    assert not (root / "mismatch" / "checkpoints").exists() and not (root / "mismatch" / "data_cache").exists()
