"""Every shipped recipe trains: each runs two steps on 2 CPU ranks as written (its objective, ZeRO stage, LoRA,
splits, tiling, packing, precision, schedule), with only what a CPU cannot hold shrunk through --set: the model
(a tiny directory of the same model_type, or GPT-2's tiny size), the data (local records of the recipe's format),
the sequence length, the batch and the parallel sizes (2 ranks). All recipes share one launch. That each recipe
fits its real hardware: tests/unit/test_recipes.py.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from launch import launch_jobs
from local_chat import conversations, make_chat_tokenizer, preference_pairs, sentence, write_jsonl

from bigtrain.recipes.catalog import recipes

ALL = recipes()


def tiny_models(root: Path) -> dict[str, Path]:
    """model_type -> a tiny directory of it (random weights, the chat tokenizer), for the Hub models the recipes
    name."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config, Qwen3MoeConfig
    tok = make_chat_tokenizer(root / "tokenizer")
    shape = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                 bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    configs = {"llama": LlamaConfig(**shape), "qwen3": Qwen3Config(**shape, head_dim=16),
               "qwen3_moe": Qwen3MoeConfig(**shape, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=48, decoder_sparse_step=1)}
    dirs = {}
    for i, (name, config) in enumerate(configs.items()):
        torch.manual_seed(i)
        AutoModelForCausalLM.from_config(config).save_pretrained(root / name)
        tok.save_pretrained(root / name)
        dirs[name] = root / name
    return dirs


def shrunk(item, models: dict[str, Path], data: dict[str, Path]) -> list[str]:
    """The recipe at a CPU's size: its own settings but the model, the data, the lengths, the batch and the splits."""
    from bigtrain.models.hub import SHAPES
    run = item.run_config()
    sets = ["train.steps=2", "train.eval_interval=0", "train.eval_batches=0", "train.sample_tokens=0",
            "checkpoint.interval=0", "checkpoint.at_end=false", "logging.progress_bar=false", "logging.interval=1",
            "schedule.warmup_steps=1", "data.num_proc=1", "data.val_fraction=0.1", "batch.micro_batch=1",
            f"data.source={data[run.data.format if run.data.format != 'auto' else 'text']}", "data.split=train"]
    if run.model.pretrained:
        model_type = json.loads((SHAPES / run.model.pretrained.replace("/", "--") / "config.json").read_text())
        sets.append(f"model.pretrained={models[model_type['model_type']]}")
    else:
        sets += ["model.size=tiny", "model.overrides={}"]
    if run.data.tokenizer:
        sets.append(f"data.tokenizer={models['llama']}")
    for axis in ("sequence", "expert"):
        if getattr(run.parallel, axis) > 1:
            sets.append(f"parallel.{axis}=2")
    # a sequence split over 2 ranks at 512 tokens keeps 256 a rank: 4 x the tiny hidden size, so tiling is on
    sets += [f"data.seq_len={512 if run.parallel.sequence > 1 else 64}", "batch.global_batch=2"]
    if run.objective.declared.generates:  # online RL: a group of 2 completions of up to 8 tokens on each rank
        sets += ["objective.num_generations=2", "objective.max_completion_length=8", "batch.micro_batch=2",
                 "batch.global_batch=4"]
    return [arg for s in sets for arg in ("--set", s)] + ["--peak-tflops", "1"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipes")
    models = tiny_models(root)
    data = {"chat": write_jsonl(root / "chat.jsonl", conversations(64)),
            "preference": write_jsonl(root / "pairs.jsonl", preference_pairs(64)),
            "prompt": write_jsonl(root / "prompts.jsonl", [{"prompt": [{"role": "user", "content": f"what is {i} + 1"}],
                                                            "answer": str(i + 1)} for i in range(64)]),
            "text": root / "corpus.txt"}
    import random
    rng = random.Random(0)
    data["text"].write_text("\n\n".join(sentence(rng, 400) for _ in range(40)))
    jobs = [{"name": item.name, "args": ["--config", str(item.path), *shrunk(item, models, data)]} for item in ALL]
    started = time.perf_counter()
    log = launch_jobs(root, jobs, name="recipes", timeout=900)
    print(f"{len(jobs)} recipes trained two steps in one 2-rank launch: {time.perf_counter() - started:.0f} s")
    return root, log


@pytest.mark.parametrize("item", ALL, ids=lambda r: r.name)
def test_a_recipe_trains_two_steps_on_cpu(trained, item):
    root, _ = trained
    summary = json.loads((root / item.name / "summary.json").read_text())
    run = item.run_config()
    assert summary["steps"] == 2 and len(summary["losses"]) == 2 and summary["world_size"] == 2, summary["losses"]
    assert all(loss == loss and loss < 50 for loss in summary["losses"])  # finite
    ds = summary["ds_config"]
    assert ds["zero_optimization"]["stage"] == run.zero.stage
    assert ("bf16" in ds and ds["bf16"]["enabled"]) == (run.precision == "bf16")
    recorded = summary["run_config"]
    assert recorded["lora"]["r"] == run.lora.r and recorded["objective"]["kind"] == run.objective.kind
    assert recorded["activation_checkpointing"]["enabled"] == run.activation_checkpointing.enabled
    for axis in ("sequence", "expert"):
        assert recorded["parallel"][axis] == min(getattr(run.parallel, axis), 2)
    if run.parallel.sequence > 1:  # Ulysses over both ranks, and ALST's tiled MLP on (256 tokens a rank)
        assert ds["sequence_parallel_size"] == 2
        assert "tiled MLP" in (root / item.name / "logs" / "rank0.log").read_text()
    if run.parallel.expert > 1:
        assert ds["expert_parallel"] == {"enabled": True, "autoep_size": 2}
    if run.objective.kind != "lm":
        assert "final_metrics" in summary and summary["final_metrics"], summary.keys()
