"""How GRPO's per-token losses add up to a step's loss: objective.loss_type, TRL 1.16's four (grpo_trainer.py
`_compute_loss`). (Its names are TRL's; "grpo" here is an aggregation, which is why they live beside the objective.)

A step's loss is split into shares: each micro-batch on each rank returns its share, and the shares of all
micro-batches on all ranks add up to the step's loss as TRL defines it. The objective multiplies a share by
(accumulation steps x data-parallel ranks) before DeepSpeed's backward, which divides by both (the rule
`Policy.token_scale` follows for token-weighted SFT). For the loss types:

    grpo      each sequence's token mean, averaged over the micro-batch's sequences       share = that / M
    bnpo      the micro-batch's token mean                                                 share = that / M
    dr_grpo   the micro-batch's token sum / (its sequences x max_completion_length)        share = that / M
    dapo      the token sum / the active tokens of the whole step (all micro-batches, all ranks)

M = `step_micro_batches` (accumulation steps x ranks); `step_tokens` (dapo) is counted once per step over every
rank (`bigtrain.rollout.losses.global_count`). TRL's own normaliser for dapo, num_items_in_batch / processes x
accumulation / steps_per_generation, is the same number when a generation batch is one optimizer step (its
default, and with num_iterations > 1 each of its steps).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, *, step_micro_batches: int,
              step_tokens: float | torch.Tensor | None = None,
              max_completion_length: int | None = None) -> torch.Tensor:
    """This micro-batch's share of the step's loss (see the module's docstring)."""
    import torch
    masked = per_token * mask
    if loss_type == "dapo":
        assert step_tokens is not None, "dapo divides by the step's active tokens: count them (global_count)"
        total = torch.as_tensor(step_tokens, dtype=masked.dtype, device=masked.device)
        return masked.sum() / total.clamp(min=1.0)
    if loss_type == "grpo":
        value = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        value = masked.sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        assert max_completion_length, "dr_grpo divides by max_completion_length"
        value = masked.sum() / (mask.shape[0] * max_completion_length)
    else:
        raise ValueError(f"objective.loss_type={loss_type!r}: must be one of {', '.join(LOSS_TYPES)}")
    return value / step_micro_batches
