"""Run by tests/dist/test_rl_learning.py and test_agentic_learning.py: TRL 1.16's own GRPOTrainer and RLOOTrainer on
tests/rl_task.py's task (or an environment's), one run after another in one process, each as a user runs it (the
model directory, the records, the reward functions, the sizes and the rate given; everything else TRL's default),
writing each step's mean reward, the rate each step applied and the optimizer's settings as the trainer's own
objects hold them.

Usage: trl_online_runs.py ROOT PLAN.json, the plan a list of {"name", "algorithm": "grpo" | "rloo", "seed",
"model", "records", "settings": {GRPOConfig / RLOOConfig fields}}; writes ROOT/NAME.json {"rewards": [...], "lrs":
[...], "settings": {...}, "metrics": {name: [each step's value]}} (`bigtrain.bench.baseline_trl.effective_settings`:
betas, eps, weight decay, clipping, ...). A job with "environment": "FILE.py:CLASS" and "rewards": ["FILE.py:FUNCTION",
...] runs GRPOTrainer's environment_factory (tests/dist/test_agentic_learning.py) with those reward functions instead
of rl_task's.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import rl_task  # noqa: E402


def correct(completions: list, answer: list, **kwargs: object) -> list[float]:
    return rl_task.correct(completions, answer)


def digit_format(completions: list, completion_ids: list, **kwargs: object) -> list[float]:
    return rl_task.digit_format(completions, completion_ids)


def run(root: Path, job: dict) -> None:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    from bigtrain.bench.baseline_trl import effective_settings
    from bigtrain.rollout.rewards import load_function as load  # FILE.py:NAME, as bigtrain reads the same files

    lrs: list[float] = []

    class AppliedRate(TrainerCallback):
        def on_step_begin(self, args, state, control, lr_scheduler=None, **kwargs):  # the rate this step applies
            lrs.append(lr_scheduler.get_last_lr()[0])

    config, trainer = (GRPOConfig, GRPOTrainer) if job["algorithm"] == "grpo" else (RLOOConfig, RLOOTrainer)
    records = [json.loads(line) for line in Path(job["records"]).read_text().splitlines()]
    args = config(output_dir=str(root / job["name"]), use_cpu=True, bf16=False, seed=job["seed"], logging_steps=1,
                  report_to=[], save_strategy="no", disable_tqdm=True, **job["settings"])
    tools = {"environment_factory": load(job["environment"])} if job.get("environment") else {}
    rewards = [load(r) for r in job["rewards"]] if job.get("rewards") else [correct, digit_format]
    run = trainer(model=job["model"], reward_funcs=rewards, args=args, train_dataset=Dataset.from_list(records),
                  processing_class=AutoTokenizer.from_pretrained(job["model"]), callbacks=[AppliedRate()], **tools)
    run.train()
    steps = [h for h in run.state.log_history if "reward" in h]
    metrics = {k: [h.get(k) for h in steps] for k in steps[0] if isinstance(steps[0][k], (int, float))}
    settings = effective_settings(run, job["algorithm"])
    (root / f"{job['name']}.json").write_text(json.dumps(
        {"rewards": metrics["reward"], "lrs": lrs, "settings": settings, "metrics": metrics}, default=str))


def main() -> None:
    root, plan = Path(sys.argv[1]), Path(sys.argv[2])
    for job in json.loads(plan.read_text()):
        run(root, job)


if __name__ == "__main__":
    main()
