"""`objective.kind: reward`: a reward model, trained on pairs as TRL's RewardTrainer does.

The model is a causal-LM directory loaded as `AutoModelForSequenceClassification` with one label
(its `Needs.head`, `bigtrain.models.registry.model_overrides`): its scalar head reads each row at the conversation's
last token, the last that is not config.pad_token_id, which is the tokenizer's pad the rows are padded with
(bigtrain.data.pairs): the row transformers reads when a user scores the conversation alone or in a batch the
tokenizer padded, on either side. The loss is -log sigmoid(r_chosen - r_rejected) averaged over the pairs
(Bradley-Terry). The metrics are TRL's RewardTrainer's: accuracy (the share of pairs ranked right), margin (the mean
r_chosen - r_rejected), and min_reward, mean_reward, max_reward over the micro-batch's rows, chosen and rejected (TRL
takes the min and max of a micro-batch gathered over the processes; here of each rank's micro-batch, averaged like
every metric, so that 2 ranks report what one process with accumulation does).
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from bigtrain.objectives.base import FineTuning, Metrics, Objective, Policy
from bigtrain.objectives.preference import PAIRS

if TYPE_CHECKING:
    import torch


class RewardLoss(Objective):
    needs = replace(PAIRS, head="scalar")
    fine_tuning = FineTuning(lr=1e-4)  # TRL's RewardConfig
    summary = "a scalar reward head trained on pairs, -log sigmoid(r_chosen - r_rejected)"
    samples = "pairs"

    def inputs(self, policy: Policy, batch: dict) -> Any:
        from bigtrain.data.pairs import flat_pairs
        return policy.to_device({"input_ids": flat_pairs(batch)["input_ids"]})

    def micro_loss(self, policy: Policy, item: Any, step: Any) -> tuple[torch.Tensor, Metrics]:
        return reward_loss(policy.logits(item).squeeze(-1))


def reward_loss(rewards: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
    """Rows: the n chosen answers' rewards, then the n rejected ones'."""
    import torch
    import torch.nn.functional as F
    n = rewards.shape[0] // 2
    chosen, rejected = rewards[:n].float(), rewards[n:].float()
    loss = -F.logsigmoid(chosen - rejected).mean()
    metrics = {"accuracy": (chosen > rejected).float().mean(), "margin": (chosen - rejected).mean(),
               "min_reward": rewards.min().float(), "mean_reward": rewards.float().mean(),
               "max_reward": rewards.max().float()}
    return loss, {k: v.detach().to(torch.float64) for k, v in metrics.items()}
