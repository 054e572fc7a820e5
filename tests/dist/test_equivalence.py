"""Every parallel mode trains the same model the same way: per-step losses of ZeRO 1-3, CPU
offload, a 2-stage pipeline and activation checkpointing match ZeRO-0 within 1e-4 relative, for
GPT-2, a Llama decoder (grouped-query attention, SwiGLU, rotary) and ResNet. Every mode starts
from the weights the seed gives (`bigtrain.models.init`): nothing is patched or copied between
runs, so the first step's loss is the same too.

2 ranks, fp32, same seed and data, 10 steps, global batch 8. One launch runs every mode of every
model in turn (tests/dist_scripts/equiv_runs.py), since start-up dominates on 2 cores; the
pipelines go last (DeepSpeed keeps a pipeline's grid for the rest of the process).

Why the per-step data is the same in every mode: the sampler deals one global order, rank r
of W taking positions r, r+W, ...; a step consumes micro x accum x W consecutive positions.
Data-parallel runs use micro 4 x accum 1 x dp 2; the pipeline (2 stages on 2 ranks, so dp 1)
uses micro 4 x accum 2 x dp 1. Step k covers global positions 8k..8k+7 in both (checked in
tests/unit/test_data.py: test_pipeline_and_data_parallel_steps_see_the_same_samples), and GPT-2's loss is the mean over
equal-sized micro-batches, so the step's loss and gradient are the same. ResNet has
BatchNorm, whose batch statistics depend on which samples share a micro-batch: it runs with
micro-batch 1 (accum 4 x dp 2, and accum 8 in the pipeline), so every micro-batch is one sample
in every layout.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch import launch_jobs

STEPS = 10  # ResNet (micro-batch 1, BatchNorm) needs ~10 steps before its loss falls clearly
RTOL = 1e-4
COMMON = ["--size", "tiny", "--set", "precision=fp32", "--set", "logging.progress_bar=false",
          "--set", "train.sample_tokens=0", "--peak-tflops", "1", "--steps", str(STEPS),
          "--set", "train.eval_interval=0", "--set", "train.eval_batches=0", "--set", "batch.global_batch=8"]
MODEL_ARGS = {
    "gpt2": ["--set", "data.vocab_size=512", "--set", "data.seq_len=64", "--set", "batch.micro_batch=4"],
    "resnet": ["--model", "resnet", "--data", "synthetic", "--set", "batch.micro_batch=1"],
    "llama": ["--model", "llama", "--set", "data.vocab_size=512", "--set", "data.seq_len=64",
              "--set", "batch.micro_batch=4"],
}
MODES = {  # name -> run-config overrides; the pipeline goes last (see equiv_runs.py)
    "zero0": ["zero.stage=0"],
    "zero1": ["zero.stage=1"],
    "zero2": ["zero.stage=2"],
    "zero3": ["zero.stage=3"],
    "zero2_offload": ["zero.stage=2", "offload.optimizer=cpu"],
    "zero3_offload": ["zero.stage=3", "offload.optimizer=cpu", "offload.param=cpu"],
    "zero0_ckpt": ["zero.stage=0", "activation_checkpointing.enabled=true"],
    "zero3_ckpt": ["zero.stage=3", "activation_checkpointing.enabled=true"],
    "pipeline": ["zero.stage=1", "pipeline.stages=2"],
}
# Blocks each model checkpoints (GPT-2 and Llama tiny: 2 decoder blocks; ResNet tiny: 4 basic blocks)
# times micro-batches per optimizer step per rank.
CHECKPOINTED_CALLS_PER_STEP = {"gpt2": 2 * 1, "llama": 2 * 1, "resnet": 4 * 4}


def losses(root: Path, name: str) -> list[float]:
    return json.loads((root / name / "summary.json").read_text())["losses"]


def max_rel_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == STEPS, (len(a), len(b))
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def probe(root: Path, name: str, rank: int = 0) -> dict:
    return json.loads((root / name / f"probe_rank{rank}.json").read_text())


@pytest.fixture(scope="module")
def all_runs(tmp_path_factory) -> Path:
    """ROOT: one launch ran every mode of MODES for every model under ROOT/<model>/<mode>, the pipelines last."""
    root = tmp_path_factory.mktemp("equiv")
    jobs, pipelines = [], []
    for model, model_args in MODEL_ARGS.items():
        for name, sets in MODES.items():
            args = [*COMMON, *model_args] + [a for s in sets for a in ("--set", s)]
            (pipelines if name == "pipeline" else jobs).append({"name": f"{model}/{name}", "args": args})
    launch_jobs(root, jobs + pipelines)
    return root


@pytest.fixture(params=list(MODEL_ARGS))
def runs(request, all_runs) -> tuple[str, Path]:
    """(model, ROOT): every mode of MODES for this model ran under ROOT/<mode>."""
    return request.param, all_runs / request.param


@pytest.mark.parametrize("mode", ["zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"])
def test_zero_stages_and_offload_match_zero0(runs, mode):
    model, root = runs
    base = losses(root, "zero0")
    assert base[-1] < base[0] - 0.01, base  # a curve that moves, not a constant
    diff = max_rel_diff(losses(root, mode), base)
    print(f"{model} {mode}: max relative loss difference to ZeRO-0 {diff:.2e}")  # pytest -s
    assert diff <= RTOL, (mode, losses(root, mode), base)


@pytest.mark.parametrize("mode", ["zero1", "zero3", "zero3_offload"])
def test_gradient_norms_match_zero0(runs, mode):
    """Each step's gradient norm before clipping (the step line's `grad norm`, summary.json's grad_norms): at ZeRO-0
    in fp32 bigtrain measures it (DeepSpeed clips with a norm it drops), at ZeRO 1-3 DeepSpeed's optimizers give
    theirs: two implementations, one number."""
    model, root = runs
    base = json.loads((root / "zero0" / "summary.json").read_text())["grad_norms"]
    other = json.loads((root / mode / "summary.json").read_text())["grad_norms"]
    assert len(base) == len(other) == STEPS and all(0 < n < float("inf") for n in base), base
    assert max_rel_diff(other, base) <= 1e-3, (mode, other, base)


def test_cpu_offload_runs_deepspeed_cpu_adam(runs):
    """Offload swaps torch's AdamW for DeepSpeed's C++ CPU Adam: the matching curves above check its math."""
    _, root = runs
    assert probe(root, "zero0")["base_optimizer"] == "AdamW"
    assert probe(root, "zero2")["base_optimizer"] == "AdamW"
    for mode in ("zero2_offload", "zero3_offload"):
        assert probe(root, mode)["base_optimizer"] == "DeepSpeedCPUAdam", probe(root, mode)
    assert probe(root, "zero2")["optimizer"] == "DeepSpeedZeroOptimizer"
    assert probe(root, "zero3_offload")["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"


def test_pipeline_matches_data_parallel(runs):
    """2 stages x dp 1 against dp 2, the same global batch, from the same initial weights."""
    model, root = runs
    pipe = json.loads((root / "pipeline" / "summary.json").read_text())["ds_config"]
    plain = json.loads((root / "zero0" / "summary.json").read_text())["ds_config"]
    micro = 1 if model == "resnet" else 4
    assert (pipe["train_micro_batch_size_per_gpu"], pipe["gradient_accumulation_steps"]) == (micro, 8 // micro)
    assert (plain["train_micro_batch_size_per_gpu"], plain["gradient_accumulation_steps"]) == (micro, 4 // micro)
    assert pipe["pipeline"]["stages"] == 2
    diff = max_rel_diff(losses(root, "pipeline"), losses(root, "zero0"))
    print(f"{model} pipeline: max relative loss difference to ZeRO-0 {diff:.2e}")
    assert diff <= RTOL


@pytest.mark.parametrize("mode, reference", [("zero0_ckpt", "zero0"), ("zero3_ckpt", "zero3")])
def test_activation_checkpointing_leaves_losses_unchanged(runs, mode, reference):
    model, root = runs
    calls = STEPS * CHECKPOINTED_CALLS_PER_STEP[model]
    assert [probe(root, mode, r)["checkpoint_calls"] for r in (0, 1)] == [calls, calls]
    assert probe(root, reference)["checkpoint_calls"] == 0
    diff = max_rel_diff(losses(root, mode), losses(root, reference))
    print(f"{model} {mode}: max relative loss difference to {reference} {diff:.2e}")
    assert diff <= RTOL
