"""`objective.kind: kto`: Kahneman-Tversky Optimization on unpaired answers marked desirable or not (TRL's
KTOTrainer: its formula, defaults and metric names).

With r(y) = log pi(y) - log ref(y) an answer's log-ratio to the reference and z0 the KL estimate (the mean of
r over each prompt paired with another prompt's answer, averaged over the data-parallel ranks, at least 0, no
gradient):

    desirable     desirable_weight * (1 - sigmoid(beta (r(y) - z0)))
    undesirable   undesirable_weight * (1 - sigmoid(beta (z0 - r(y))))

averaged over the micro-batch's answers. Metrics: kl, rewards/chosen and rewards/rejected (beta r over the
desirable and the undesirable answers; 0 when a micro-batch has none), logps/chosen, logps/rejected.
"""
from __future__ import annotations

from typing import Any

import torch

from bigtrain.config.run_config import ObjectiveConfig
from bigtrain.data.pairs import flat_pairs
from bigtrain.models.spec import call_module, output_logits
from bigtrain.objectives.base import Metrics, Objective
from bigtrain.objectives.preference import answer_logps


class KTOLoss(Objective):
    kind = "kto"
    pairs = True  # two rows a sample: the answer and its KL counterpart
    uses_reference = True
    metric_names = ("kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")

    def __init__(self, cfg: ObjectiveConfig):
        self.cfg = cfg

    def inputs(self, engine: Any, batch: dict) -> Any:
        rows = flat_pairs(batch)
        desirable = rows.pop("desirable")
        inputs, labels = engine.spec.batch_to_inputs(rows)
        return engine.to_device(inputs), labels.to(engine.device), desirable.to(engine.device)

    def micro_loss(self, engine: Any, item: Any, step: Any) -> tuple[torch.Tensor, Metrics]:
        inputs, labels, desirable = item
        ref = engine.reference_logps(inputs, labels)  # first: its logits are gone before the policy's graph is built
        logps, _ = answer_logps(output_logits(call_module(engine.ds, inputs)), labels)
        n = logps.shape[0] // 2
        kl = (logps[n:] - ref[n:]).detach().mean()
        if torch.distributed.is_initialized():  # TRL gathers the estimate over the processes
            kl = kl.clone()
            torch.distributed.all_reduce(kl)
            kl = kl / torch.distributed.get_world_size()
        return kto_loss(self.cfg, logps[:n], ref[:n], desirable, kl.clamp(min=0))

    def flops_factor(self) -> float:
        """The answer and its counterpart through the policy (the counterpart's backward is wasted work), both
        through the reference (forward only)."""
        return 2.0 * (1 + 1 / 3)


def kto_loss(cfg: ObjectiveConfig, logps: torch.Tensor, ref: torch.Tensor, desirable: torch.Tensor,
             kl: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
    ratio = logps - ref
    good, bad = desirable.bool(), ~desirable.bool()
    losses = torch.where(good, cfg.desirable_weight * (1 - torch.sigmoid(cfg.beta * (ratio - kl))),
                         cfg.undesirable_weight * (1 - torch.sigmoid(cfg.beta * (kl - ratio))))

    def mean_of(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return (values * mask).sum() / mask.sum().clamp(min=1)

    metrics = {"kl": kl, "rewards/chosen": mean_of(cfg.beta * ratio, good),
               "rewards/rejected": mean_of(cfg.beta * ratio, bad), "logps/chosen": mean_of(logps, good),
               "logps/rejected": mean_of(logps, bad)}
    return losses.mean(), {k: v.detach().to(torch.float64) for k, v in metrics.items()}
