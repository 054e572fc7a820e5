"""Training objectives: what a micro-batch's loss and metrics are, which data shape it reads, and whether it needs a
frozen reference model. The stepper (bigtrain.train.engine) calls one method and knows no objective by name.

    lm        the model's own loss: next-token cross-entropy (plain, chunked, sequence-parallel, token-weighted,
              a mixture of experts' router term), a classifier's cross-entropy        (causal_lm.py)
    dpo, ipo  pairs of answers against a frozen reference                               (preference.py)
    orpo, simpo  pairs of answers, no reference                                         (preference.py)
    kto       unpaired answers marked desirable or not, against a reference             (kto.py)
    reward    a scalar head on pairs: -log sigmoid(r_chosen - r_rejected)               (reward.py)

Adding an objective: its file, and a line in OBJECTIVES.
"""
from __future__ import annotations

from typing import Any, Callable

from bigtrain.config.run_config import ObjectiveConfig
from bigtrain.objectives.base import Objective
from bigtrain.objectives.causal_lm import ModelLoss
from bigtrain.objectives.kto import KTOLoss
from bigtrain.objectives.preference import PreferenceLoss
from bigtrain.objectives.reward import RewardLoss

OBJECTIVES: dict[str, Callable[[ObjectiveConfig], Objective]] = {
    "lm": lambda cfg: ModelLoss(),
    "dpo": PreferenceLoss, "ipo": PreferenceLoss, "orpo": PreferenceLoss, "simpo": PreferenceLoss, "kto": KTOLoss,
    "reward": lambda cfg: RewardLoss(),
}


def build_objective(cfg: ObjectiveConfig, lora: bool = False) -> Objective:
    """The run's objective, its reference resolved (`objective.reference: auto`: adapters_off with LoRA, else a
    frozen copy, for the objectives that compare with one)."""
    objective = OBJECTIVES[cfg.kind](cfg)
    if objective.uses_reference:
        objective.reference = ("adapters_off" if lora else "copy") if cfg.reference == "auto" else cfg.reference
    return objective


def model_overrides(cfg: ObjectiveConfig, family_settings: Any, pad_token_id: int | None) -> dict[str, Any]:
    """Model overrides an objective needs: a reward model is the causal-LM directory with a one-label scalar head
    (AutoModelForSequenceClassification), which reads each row at its last token that is not `pad_token_id`: the
    id the rows are padded with (`bigtrain.data.tokenizer.pad_id`), also what the export's config.json says."""
    if cfg.kind != "reward":
        return {}
    from dataclasses import fields
    names = {f.name for f in fields(family_settings)}
    if not {"task", "num_classes"} <= names:
        raise ValueError("objective.kind=reward puts a scalar head on the model: give a Hugging Face directory "
                         "(--model hf --set model.pretrained=DIR, a causal LM is loaded as "
                         "AutoModelForSequenceClassification with one label); this family has no such head")
    return {"task": "classify", "num_classes": 1, "pad_token_id": pad_token_id}


__all__ = ["OBJECTIVES", "Objective", "build_objective", "model_overrides"]
