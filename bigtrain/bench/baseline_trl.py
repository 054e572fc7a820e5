"""The TRL baseline of `bigtrain bench --trl`: TRL's own trainer (SFTTrainer, DPOTrainer or GRPOTrainer) on the job's
model, data and config, in one process on the CPU, as a TRL user runs it; no bigtrain code on its path but the
reward function GRPO is given (the built-in `accuracy`, the same function bigtrain calls).

    python -m bigtrain.bench.baseline_trl --job job.json --out DIR      # writes DIR/result.json

It records when each optimizer step ended (`time.time()`, and the process's CPU seconds then, TRL's `on_step_end`:
after the optimizer step, before the step's logging, where bigtrain's step clock also stops), TRL's log of every
step, and the settings the trainer ran with, read back from the trainer itself (`effective_settings`).
"""
from __future__ import annotations

import time

STARTED = time.time()  # before any import of weight: the process's own account of its start-up

import argparse  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

TRAINERS = {"sft": ("SFTTrainer", "SFTConfig"), "dpo": ("DPOTrainer", "DPOConfig"),
            "grpo": ("GRPOTrainer", "GRPOConfig")}


def reward_function(spec: str) -> Any:
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def build(job: dict, marks: dict) -> Any:
    """TRL's trainer for the job, with a callback that keeps each step's end."""
    import trl
    from datasets import load_dataset
    from transformers import TrainerCallback
    marks["imported"] = time.time()
    trainer_name, config_name = TRAINERS[job["objective"]]
    config = getattr(trl, config_name)(**job["config"])
    data = load_dataset("json", data_files=job["data"], split="train")
    step_ends: list[float] = marks.setdefault("step_end_unix", [])
    step_cpu: list[float] = marks.setdefault("step_end_cpu_s", [])

    class StepEnds(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            step_ends.append(time.time())
            step_cpu.append(time.process_time())

    kwargs: dict[str, Any] = {"model": job["model"], "args": config, "train_dataset": data, "callbacks": [StepEnds()]}
    if job["objective"] == "grpo":
        kwargs["reward_funcs"] = [reward_function(spec) for spec in job["rewards"]]
    trainer = getattr(trl, trainer_name)(**kwargs)
    marks["trainer_built"] = time.time()
    return trainer


def effective_settings(trainer: Any, objective: str) -> dict[str, Any]:
    """What the trainer ran with, read from its objects (not from what it was asked)."""
    import torch
    args = trainer.args
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate wraps it
    group = optimizer.param_groups[0]
    model = trainer.model
    out = {"optimizer": f"{type(optimizer).__module__}.{type(optimizer).__name__}",
           "betas": list(group["betas"]), "eps": group["eps"], "weight_decay": group["weight_decay"],
           "grad_clip": args.max_grad_norm, "lr_scheduler": str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)), "warmup_steps": args.warmup_steps,
           "micro_batch": args.per_device_train_batch_size, "grad_accum": args.gradient_accumulation_steps,
           "processes": trainer.accelerator.num_processes, "seed": args.seed,
           "dtype": str(next(model.parameters()).dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
           "device": str(trainer.accelerator.device), "dropout_disabled": getattr(args, "disable_dropout", None)}
    if objective in ("sft", "dpo"):
        out.update(max_length=args.max_length, padding="padding-free" if args.padding_free else
                   "to the batch's longest row")
    if objective == "sft":
        out.update(packing=args.packing, assistant_only_loss=args.assistant_only_loss,
                   completion_only_loss=args.completion_only_loss)
    if objective == "dpo":
        out.update(beta=args.beta, loss_type=list(args.loss_type), reference="a frozen copy" if trainer.ref_model is not None
                   else "none", precompute_ref_log_probs=args.precompute_ref_log_probs)
    if objective == "grpo":
        gen = trainer.generation_config
        out.update(beta=trainer.beta, loss_type=trainer.loss_type, num_generations=trainer.num_generations,
                   generation_batch_size=args.generation_batch_size, steps_per_generation=args.steps_per_generation,
                   num_iterations=trainer.num_iterations, epsilon_low=trainer.epsilon_low,
                   epsilon_high=trainer.epsilon_high, scale_rewards=args.scale_rewards,
                   importance_sampling_level=trainer.importance_sampling_level,
                   max_completion_length=trainer.max_completion_length, temperature=gen.temperature,
                   top_p=gen.top_p, top_k=gen.top_k, do_sample=gen.do_sample, max_new_tokens=gen.max_new_tokens,
                   use_bias_correction_kl=args.use_bias_correction_kl,
                   decode="transformers' continuous batching" if args.use_transformers_continuous_batching
                   else "transformers' generate",
                   mask_truncated_completions=args.mask_truncated_completions)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--job", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    job = json.loads(Path(args.job).read_text())
    marks: dict = {"started": STARTED}
    trainer = build(job, marks)
    trainer.train()
    marks["trained"] = time.time()
    import torch
    import transformers
    import trl
    steps = [h for h in trainer.state.log_history if "step" in h and "train_runtime" not in h]
    result = {**marks, "log": steps, "settings": effective_settings(trainer, job["objective"]),
              "lrs": [h.get("learning_rate") for h in steps],
              "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
