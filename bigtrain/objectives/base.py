"""The contract between the stepper and an objective."""
from __future__ import annotations

from typing import Any

import torch

Metrics = dict[str, torch.Tensor]  # detached scalars on the device, averaged over micro-batches and ranks


class Objective:
    """One training objective. The stepper, per optimizer step: `begin_step` on the step's micro-batches (each
    already `inputs`' output), then `micro_loss` on each, backward on the loss it returns; in evaluation
    `eval_loss` per batch."""

    kind = "lm"
    pairs = False  # reads preference pairs (bigtrain.data.pairs), not single examples
    uses_reference = False  # compares with a frozen reference model (objective.reference)
    reference = "none"  # resolved by build_objective: none | adapters_off | copy | precomputed
    metric_names: tuple[str, ...] = ()

    def inputs(self, engine: Any, batch: dict) -> Any:
        """A micro-batch on the device, in the form `micro_loss` takes."""
        inputs, labels = engine.spec.batch_to_inputs(batch)
        return engine.to_device(inputs), labels.to(engine.device)

    def begin_step(self, engine: Any, micro: list[Any]) -> Any:
        """Whatever the step's micro-batches share (a token count, say); None by default."""
        return None

    def micro_loss(self, engine: Any, item: Any, step: Any) -> tuple[torch.Tensor, Metrics]:
        raise NotImplementedError

    def eval_loss(self, engine: Any, item: Any) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
        """(loss, its weight in the evaluation's mean, metrics) of one held-out batch, without gradients."""
        loss, metrics = self.micro_loss(engine, item, None)
        return loss, torch.ones((), dtype=torch.float64, device=loss.device), metrics

    def flops_factor(self) -> float:
        """FLOPs of a sample against the model's 6N-per-token training FLOPs of one row."""
        return 1.0

    def rows_per_sample(self) -> int:
        return 2 if self.pairs else 1
