"""Agentic GRPO learns as far as TRL's own GRPOTrainer with the same environment, run the way a user runs both.

The task (tests/tool_task.py: LEARNING_VAULT): "open box 3" -> call open_box(box=3) -> the vault answers " 7", the
record's own code, which no prompt shows -> answer "code 7". No model can answer right without opening the box. A tiny
random Llama (2 layers, 128 wide) is first taught the call format by `bigtrain train` (one process) on demonstrations
of which half call and answer the code and half answer "unknown" at once, and exported: the fine-tuned model calls
about half the time. Then GRPO in the vault, the reward function `opened_and_right` (1.0 when the prompt's box was
opened and the answer is its code) and the vault's own get_reward (0.5 for opening the box): TRL 1.16's GRPOTrainer
(environment_factory, tests/dist_scripts/trl_online_runs.py) in one process, bigtrain's runs in one launch of 2 ranks
at ZeRO-3, five seeds each, the same model directory, records, environment, reward function, sizes, rate and steps,
everything else each side's default.

What rises is the share of rollouts that call the tool and answer right (`rewards/opened_and_right/mean`). A run's
rise is its mean share over the last half of its steps minus the mean first-step share of every run (all sample
their first step from the same model on the same prompts: tests/dist/test_rl_learning.py's pooled start). The median
rise of bigtrain's seeds must reach 0.9 x the median of TRL's, and TRL's must pass 0.2 (the task learns within the
steps).
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

import tool_task as tt
from launch import REPO, launch_jobs, rank_env, summary

# five seeds, not three: of six seeds run here, the medians' ratio over any three of them ranged 0.71-1.11 (4 of the 20
# choices under 0.9), over any five 0.95-0.98: a CPU whose arithmetic draws other samples is a fresh choice
SEEDS = (1, 2, 3, 4, 5)
STEPS, RATE, BATCH, GROUP, WIDTH = 16, 1e-3, 32, 8, 48  # 32 completions a step: 4 prompts x 8
SHARE = "rewards/opened_and_right/mean"
# The fine-tune: 800 steps of 16 demonstrations at 3e-3 (the loss on the answer's code falls between steps 300 and
# 400: before, the model copies no code; 96 tokens hold a whole demonstration, its end-of-turn included)
SFT = {"demos": 2000, "steps": 800, "lr": 3e-3, "seq_len": 96}


def sets(*items: str) -> list[str]:
    return [a for item in items for a in ("--set", item)]


QUIET = sets("precision=fp32", "logging.progress_bar=false", "train.sample_tokens=0", "train.eval_batches=0",
             "logging.csv=false")


@pytest.fixture(scope="module")
def curves(tmp_path_factory) -> dict[str, dict]:
    """Each run's per-step metrics: "trl/1", "bigtrain/2", ..."""
    from bigtrain.export import export_checkpoint
    root = tmp_path_factory.mktemp("agentic_learning")
    tok = tt.make_tokenizer(root / "base", compact=True)
    tt.make_model(tok, 0, root / "base", layers=2, width=128)
    tt.write_jsonl(root / "demos.jsonl", tt.learning_demonstrations(SFT["demos"]))
    tt.write_jsonl(root / "prompts.jsonl", tt.learning_records(400, seed=1))
    vault = root / "vault.py"
    vault.write_text(tt.LEARNING_VAULT)
    launch_jobs(root, [{"name": "sft", "args": [
        "--model", "hf", "--set", f"model.pretrained={root / 'base'}", "--data", str(root / "demos.jsonl"),
        "--steps", str(SFT["steps"]), *sets(f"data.seq_len={SFT['seq_len']}", f"optimizer.lr={SFT['lr']}",
                                            "batch.micro_batch=16", "batch.global_batch=16", "logging.interval=50"),
        *QUIET]}], num_ranks=1, name="sft", timeout=600)
    model = root / "sft_model"
    export_checkpoint(root / "sft", model)

    trl = [{"name": f"trl_{seed}", "algorithm": "grpo", "seed": seed, "model": str(model),
            "records": str(root / "prompts.jsonl"), "environment": f"{vault}:Vault",
            "rewards": [f"{vault}:opened_and_right"],
            "settings": {"per_device_train_batch_size": BATCH, "num_generations": GROUP, "learning_rate": RATE,
                         "max_completion_length": WIDTH, "max_steps": STEPS}} for seed in SEEDS]
    (root / "trl.json").write_text(json.dumps(trl))
    done = subprocess.run([sys.executable, str(REPO / "tests" / "dist_scripts" / "trl_online_runs.py"), str(root),
                           str(root / "trl.json")], cwd=REPO, env=rank_env(TRL_EXPERIMENTAL_SILENCE="1"),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    out = {f"trl/{seed}": json.loads((root / f"trl_{seed}.json").read_text())["metrics"] for seed in SEEDS}

    jobs = [{"name": f"bigtrain_{seed}", "args": [
        "--model", "hf", "--set", f"model.pretrained={model}", "--data", str(root / "prompts.jsonl"),
        "--steps", str(STEPS),
        *sets("objective.kind=grpo", f"objective.environment={vault}:Vault",
              f"objective.rewards=[{vault}:opened_and_right]", f"objective.max_completion_length={WIDTH}",
              f"objective.num_generations={GROUP}", f"data.seq_len={WIDTH + 32}", f"batch.global_batch={BATCH}",
              f"batch.micro_batch={BATCH // 2}", f"optimizer.lr={RATE}", f"train.seed={seed}", "zero.stage=3",
              "logging.interval=1", "checkpoint.at_end=false"), *QUIET]} for seed in SEEDS]
    launch_jobs(root, jobs, num_ranks=2, name="zero3", timeout=600)
    for seed in SEEDS:
        metrics = summary(root / f"bigtrain_{seed}")["metrics"]
        out[f"bigtrain/{seed}"] = {name: [v for _, v in values] for name, values in metrics.items()}
    return out


def rise(shares: list[float], start: float) -> float:
    half = shares[len(shares) // 2:]
    return sum(half) / len(half) - start


def test_grpo_raises_the_share_that_calls_and_answers_right_as_far_as_trls(curves):
    shares = {name: m[SHARE] for name, m in curves.items()}
    assert all(len(s) == STEPS for s in shares.values()), {n: len(s) for n, s in shares.items()}
    start = statistics.mean(s[0] for s in shares.values())
    theirs = [rise(shares[f"trl/{s}"], start) for s in SEEDS]
    ours = [rise(shares[f"bigtrain/{s}"], start) for s in SEEDS]
    for name, m in curves.items():
        print(f"{name}: share that calls and answers right {[round(v, 2) for v in m[SHARE]]}, calls per rollout "
              f"{[round(v, 2) for v in m['tools/call_frequency']]}")
    print(f"rise over {STEPS} steps from {start:.3f}: bigtrain at ZeRO-3 on 2 ranks {[round(x, 3) for x in ours]}, "
          f"TRL {[round(x, 3) for x in theirs]}")
    assert 0.2 < start < 0.8, start  # the fine-tuned model calls and copies, but not always
    assert statistics.median(theirs) > 0.2, theirs  # the task learns within the steps
    assert statistics.median(ours) >= 0.9 * statistics.median(theirs), (ours, theirs)
