"""Training from local Hugging Face directories (tests/local_hf.py) in one 2-rank launch
(tests/dist_scripts/hf_runs.py): each decoder trains under ZeRO-3 from its directory, resumes on the same
curve, and exports to a directory that `from_pretrained` loads with the trained model's logits; the
classifier trains on a 2-label jsonl file and reports accuracy; a mismatched --model stops before training; the
Llama directory trains tensor parallel at ZeRO-3 like data parallel.
What `--model hf` decides from a directory, without ranks: tests/unit/test_hf_models.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from launch import REPO, launch_jobs
from local_hf import DECODERS, SEQ, make_hf_dirs
from messages import naming

STEPS = 6
COMMON = ["--set", "precision=fp32", "--set", "logging.progress_bar=false", "--set", "train.sample_tokens=0",
          "--peak-tflops", "1", "--set", "zero.stage=3", "--set", f"data.seq_len={SEQ}", "--set", "batch.micro_batch=2",
          "--set", "data.num_proc=1",
          "--set", "batch.global_batch=8", "--set", "schedule.kind=constant", "--set", "schedule.warmup_steps=1",
          "--set", "optimizer.lr=3e-3",
          "--set", "train.eval_interval=0", "--set", "train.eval_batches=0", "--set", "logging.interval=1"]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    return make_hf_dirs(tmp_path_factory.mktemp("hf_dirs"))


@pytest.fixture(scope="module")
def runs(hf_dirs, tmp_path_factory) -> tuple[Path, str]:
    """(ROOT, rank 0's log): every job in one 2-rank launch."""
    root = tmp_path_factory.mktemp("hf_runs")
    data = ["--data", str(hf_dirs["corpus"])]
    jobs = []
    for arch in DECODERS:
        model = ["--model", "hf", "--set", f"model.pretrained={hf_dirs[arch]}", *data]
        jobs.append({"name": arch, "args": [*COMMON, *model, "--steps", str(STEPS), "--set", "checkpoint.interval=3"],
                     "logits": True})
        jobs.append({"name": f"{arch}_resumed", "args": [*COMMON, *model, "--steps", str(STEPS), "--resume"],
                     "resume_from": arch})
    # ALST's tiled MLP, which makes the directory's RMSNorms lean (their backward recomputed over tiles)
    jobs.append({"name": "llama_tiled", "args": [*COMMON, "--model", "hf", "--set",
                                                 f"model.pretrained={hf_dirs['llama']}", *data, "--steps", str(STEPS),
                                                 "--set", "activation_checkpointing.tiled_mlp=true"], "logits": True})
    # tensor parallel at ZeRO-3 from a directory with weights: transformers loads them inside bigtrain's zero.Init
    jobs.append({"name": "llama_tp2", "args": [*COMMON, "--model", "hf", "--set", f"model.pretrained={hf_dirs['llama']}",
                                               *data, "--steps", str(STEPS), "--set", "parallel.tensor=2"]})
    jobs.append({"name": "bert", "args": [*COMMON, "--model", "hf", "--set", f"model.pretrained={hf_dirs['bert']}",
                                          "--data", str(hf_dirs["labels"]), "--steps", "10",
                                          "--set", "train.eval_batches=4"]})
    jobs.append({"name": "mismatch", "args": [*COMMON, "--model", "gpt2", "--set",
                                              f"model.pretrained={hf_dirs['llama']}", *data], "expect_error": True})
    return root, launch_jobs(root, jobs, script=REPO / "tests" / "dist_scripts" / "hf_runs.py")


def summary(root: Path, name: str) -> dict:
    return json.loads((root / name / "summary.json").read_text())


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


def test_the_tiled_mlp_and_lean_norms_train_and_export_like_the_plain_model(runs, tmp_path):
    """The Llama directory with the tiled MLP at ZeRO-3: its RMSNorms go lean, the run's losses are the plain run's,
    and its export, reloaded by transformers' own class (plain norms), gives the logits the lean engine gave."""
    from transformers import AutoModelForCausalLM

    from bigtrain.export import export_checkpoint
    root, log = runs
    assert naming(log, "tiled MLP", "2 MLPs", "5 RMSNorms lean"), log[-3000:]
    tiled, plain = summary(root, "llama_tiled"), summary(root, "llama")
    assert max(abs(a - b) / b for a, b in zip(tiled["losses"], plain["losses"])) <= 1e-5, (tiled, plain)
    assert export_checkpoint(root / "llama_tiled", tmp_path / "hf").max_logit_diff == 0.0
    trained = torch.load(root / "llama_tiled" / "logits.pt")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    with torch.no_grad():
        assert (model(trained["input_ids"]).logits - trained["logits"]).abs().max().item() <= 1e-5


def test_a_directory_with_weights_trains_tensor_parallel_at_zero3_like_data_parallel(runs):
    """TP2 (one data-parallel rank) and DP2 read the same 8 samples per step from the same loaded weights."""
    root, _ = runs
    tp2, dp2 = summary(root, "llama_tp2"), summary(root, "llama")
    assert tp2["ds_config"]["tensor_parallel"]["autotp_size"] == 2
    assert max(abs(a - b) / b for a, b in zip(tp2["losses"], dp2["losses"])) <= 1e-5, (tp2["losses"], dp2["losses"])


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


def test_mismatched_family_stops_before_training(runs):
    root, _ = runs
    message = (root / "mismatch" / "error.txt").read_text()
    assert "\n" not in message and "'llama' model" in message and "use --model llama" in message
    assert not (root / "mismatch" / "checkpoints").exists() and not (root / "mismatch" / "data_cache").exists()
