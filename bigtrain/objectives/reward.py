"""`objective.kind: reward`: a reward model, trained on pairs as TRL's RewardTrainer does.

The model is a causal-LM directory loaded as `AutoModelForSequenceClassification` with one label
(`bigtrain.objectives.model_overrides`): its scalar head reads each row at its last token before the padding.
The loss is -log sigmoid(r_chosen - r_rejected) averaged over the pairs (Bradley-Terry); the metrics are the mean
rewards of each side, the share of pairs ranked right (rewards/accuracies) and the mean margin.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from bigtrain.data.pairs import flat_pairs
from bigtrain.models.spec import call_module, output_logits
from bigtrain.objectives.base import Metrics, Objective
from bigtrain.objectives.preference import REWARD_METRICS


class RewardLoss(Objective):
    kind = "reward"
    pairs = True
    metric_names = REWARD_METRICS

    def inputs(self, engine: Any, batch: dict) -> Any:
        return engine.to_device({"input_ids": flat_pairs(batch)["input_ids"]})

    def micro_loss(self, engine: Any, item: Any, step: Any) -> tuple[torch.Tensor, Metrics]:
        return reward_loss(output_logits(call_module(engine.ds, item)).squeeze(-1))

    def flops_factor(self) -> float:
        return 2.0


def reward_loss(rewards: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
    """Rows: the n chosen answers' rewards, then the n rejected ones'."""
    n = rewards.shape[0] // 2
    chosen, rejected = rewards[:n].float(), rewards[n:].float()
    loss = -F.logsigmoid(chosen - rejected).mean()
    metrics = {"rewards/chosen": chosen.mean(), "rewards/rejected": rejected.mean(),
               "rewards/accuracies": (chosen > rejected).float().mean(), "rewards/margins": (chosen - rejected).mean()}
    return loss, {k: v.detach().to(torch.float64) for k, v in metrics.items()}
