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

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from bigtrain.fields import doc
from bigtrain.objectives.base import FineTuning, Metrics, Objective, Policy, check_positive
from bigtrain.objectives.preference import PAIRS

if TYPE_CHECKING:
    import torch


@dataclass(kw_only=True)
class KTOSettings:
    beta: float = doc(0.1, "kto: the strength beta of the answers' log-ratios to the reference.")
    desirable_weight: float = doc(1.0, "kto: the weight of the desirable answers' losses.")
    undesirable_weight: float = doc(1.0, "kto: the weight of the undesirable answers' losses.")

    def __post_init__(self) -> None:
        check_positive(self, "beta", note=" (TRL's default is 0.1)")
        check_positive(self, "desirable_weight", "undesirable_weight", note=" (TRL's default is 1.0)")


class KTOLoss(Objective):
    # two rows a sample: the answer and its KL counterpart
    needs = replace(PAIRS, layout="unpaired", references=("copy", "adapters_off"), min_micro_batch=2, refuses={
        **PAIRS.refuses,
        "precomputed": "kto's KL rows pair each answer with another of its batch, so their log-probabilities cannot "
                       "be computed before training",
        "micro_batch": "each answer's KL counterpart is another answer of its micro-batch, and one answer has none"})
    Settings = KTOSettings
    fine_tuning = FineTuning(lr=1e-6)  # TRL's KTOConfig
    summary = "unpaired answers marked desirable or not, against a frozen reference (TRL's KTO)"
    samples = "answers (each beside another for the KL estimate)"

    def inputs(self, policy: Policy, batch: dict) -> Any:
        from bigtrain.data.pairs import flat_pairs
        rows = flat_pairs(batch)
        desirable = rows.pop("desirable")
        inputs, labels = policy.inputs(rows)
        return inputs, labels, desirable.to(policy.device)

    def micro_loss(self, policy: Policy, item: Any, step: Any) -> tuple[torch.Tensor, Metrics]:
        import torch
        inputs, labels, desirable = item
        ref = policy.reference_logps(inputs, labels)  # first: its logits are gone before the policy's graph is built
        logps, _ = policy.answer_logps(inputs, labels)
        n = logps.shape[0] // 2
        kl = (logps[n:] - ref[n:]).detach().mean()
        if torch.distributed.is_initialized():  # TRL gathers the estimate over the processes
            kl = kl.clone()
            torch.distributed.all_reduce(kl)
            kl = kl / torch.distributed.get_world_size()
        return kto_loss(self.settings, logps[:n], ref[:n], desirable, kl.clamp(min=0))


def kto_loss(cfg: KTOSettings, logps: torch.Tensor, ref: torch.Tensor, desirable: torch.Tensor,
             kl: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
    import torch
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
