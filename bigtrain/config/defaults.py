"""The learning rate, weight decay, Adam's betas and warm-up a run trains with when it sets none, chosen by what the
run is:

    from random weights (no model.pretrained, or a directory holding a config and no weights): pretraining's,
        lr 6e-4, weight decay 0.1, betas (0.9, 0.95), 20 warm-up steps (GPT-2-style pretraining, as nanoGPT trains it)
    from a pretrained model: the objective's own (`Objective.fine_tuning`: TRL's trainer's rate for it, 10 x with
        LoRA adapters, weight decay 0, betas (0.9, 0.999) as TRL and the HF Trainer, no warm-up: the peak rate
        from the first step, as TRL's; 1 step with schedule.kind=linear, whose DeepSpeed schedule needs one)

docs/fine-tuning.md has the table beside TRL's. The run config fills the fields left unset (None) when it is built
(`filled`); whatever a user gives (--set, the config file, a DeepSpeed JSON's optimizer or scheduler) is kept as
given. What a resume keeps, and how the start line says where each value came from: `bigtrain.config.provenance`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from bigtrain.config.sections import OptimizerConfig, ScheduleConfig
from bigtrain.models.names import starts_from_weights
from bigtrain.objectives import objective_class

PRETRAINING_LR, PRETRAINING_WEIGHT_DECAY, PRETRAINING_WARMUP_STEPS = 6e-4, 0.1, 20
LINEAR_WARMUP_FLOOR = 1  # DeepSpeed's WarmupDecayLR starts at its floor: it cannot start at the peak
PRETRAINING_BETAS = (0.9, 0.95)  # GPT-3's and nanoGPT's: a shorter memory of the second moment, for loss spikes
# decided by what the run is
CHOSEN = ("optimizer.lr", "optimizer.weight_decay", "optimizer.betas", "schedule.warmup_steps")


@dataclass(frozen=True)
class Chosen:
    """The defaults of one run, and why (the start line says it)."""

    lr: float
    weight_decay: float
    betas: tuple[float, float]
    warmup_steps: int
    why: str

    def value(self, field: str) -> object:
        """The default of `field`, one of `CHOSEN`."""
        return {"optimizer.lr": self.lr, "optimizer.weight_decay": self.weight_decay, "optimizer.betas": self.betas,
                "schedule.warmup_steps": self.warmup_steps}[field]


def choose(pretrained: str | None, kind: str, lora: bool) -> Chosen:
    """The defaults for a run from `pretrained` (None: random weights) training objective `kind`, with LoRA or not."""
    if not starts_from_weights(pretrained):
        start = "no model.pretrained" if not pretrained else f"{pretrained} holds no weights"
        return Chosen(PRETRAINING_LR, PRETRAINING_WEIGHT_DECAY, PRETRAINING_BETAS, PRETRAINING_WARMUP_STEPS,
                      f"the pretraining defaults: {start}, random weights")
    tuning = objective_class(kind).fine_tuning
    assert tuning is not None, f"objective {kind} declares no fine_tuning (bigtrain.objectives.base.FineTuning)"
    return Chosen(tuning.rate(lora), tuning.weight_decay, tuning.betas, tuning.warmup_steps,
                  f"the fine-tuning defaults of objective.kind={kind} from a pretrained model"
                  + (" with LoRA adapters" if lora else ""))


def filled(optimizer: OptimizerConfig, schedule: ScheduleConfig, chosen: Chosen
           ) -> tuple[OptimizerConfig, ScheduleConfig]:
    """The two sections with the fields of `CHOSEN` they leave unset (None) set to `chosen` (new objects: a section
    shared with another run config is not changed under it)."""
    if optimizer.lr is None:
        optimizer = replace(optimizer, lr=chosen.lr)
    if optimizer.weight_decay is None:
        optimizer = replace(optimizer, weight_decay=chosen.weight_decay)
    if optimizer.betas is None:
        optimizer = replace(optimizer, betas=chosen.betas)
    if schedule.warmup_steps is None:
        schedule = replace(schedule, warmup_steps=max(chosen.warmup_steps, LINEAR_WARMUP_FLOOR)
                           if schedule.kind == "linear" else chosen.warmup_steps)
    return optimizer, schedule


def unset(optimizer: OptimizerConfig, schedule: ScheduleConfig) -> bool:
    """Whether any field of `CHOSEN` is left for the defaults."""
    return None in (optimizer.lr, optimizer.weight_decay, optimizer.betas, schedule.warmup_steps)
