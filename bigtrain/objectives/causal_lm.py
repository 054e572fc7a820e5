"""`objective.kind: lm`: the model's own loss, the way pretraining and supervised fine-tuning train.

For a causal LM the next-token cross-entropy, for a classifier its cross-entropy (and accuracy in evaluation),
computed by whatever route the engine was built with (`Policy.forward_with_loss`: plain, chunked or compiled,
over a sequence-parallel group's slices, a mixture of experts' router term added). On chat and instruction data a
step is the mean over all its answer tokens (token-weighted, `Policy.token_scale`). The one objective every mode
runs with: pipeline stages compute this loss on their last stage.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bigtrain.objectives.base import FineTuning, Metrics, Needs, Objective, Policy

if TYPE_CHECKING:
    from collections.abc import Iterator

    import torch


class ModelLoss(Objective):
    needs = Needs()
    fine_tuning = FineTuning(lr=2e-5)  # TRL's SFTConfig
    summary = "the model's own loss (next-token cross-entropy, a classifier's cross-entropy)"

    def read_step(self, policy: Policy, batches: Iterator[dict], micro_batches: int) -> list[Any]:
        """Under sequence parallelism this rank's slice of each row, and no more (`Policy.sequence_slice`): the whole
        rows every rank of a group reads are dropped here, before the step, instead of living through it (16 bytes
        per token of the group's sequence)."""
        return [policy.sequence_slice(*self.inputs(policy, next(batches))) for _ in range(micro_batches)]

    def begin_step(self, policy: Policy, micro: list[Any]) -> torch.Tensor | None:
        return policy.token_scale([labels for _, labels in micro])

    def micro_loss(self, policy: Policy, item: Any, scale: torch.Tensor | None) -> tuple[torch.Tensor, Metrics]:
        inputs, labels = item
        return policy.forward_with_loss(inputs, labels, scale)

    def eval_loss(self, policy: Policy, item: Any) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
        inputs, labels = item
        return policy.eval_with_loss(inputs, labels)
