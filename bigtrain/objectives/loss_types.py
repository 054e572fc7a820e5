"""How GRPO's per-token losses add up to a step's loss: objective.loss_type, TRL 1.16's eight (grpo_trainer.py
`_compute_loss`; how each forms its per-token loss: bigtrain.rollout.losses.grpo_terms). (Its names are TRL's;
"grpo" here is an aggregation, which is why they live beside the objective.)

A step's loss is split into shares: each micro-batch on each rank returns its share, and the shares of all
micro-batches on all ranks add up to the step's loss as TRL defines it. The objective multiplies a share by
(accumulation steps x data-parallel ranks) before DeepSpeed's backward, which divides by both (the rule
`Policy.token_scale` follows for token-weighted SFT). For the loss types:

    grpo, sapo          each sequence's token mean, averaged over the micro-batch's sequences   share = that / M
    bnpo                the micro-batch's token mean                                             share = that / M
    dr_grpo             the micro-batch's token sum / (its sequences x max_completion_length)    share = that / M
    luspo               each sequence's token sum, averaged over the micro-batch's sequences     share = that / M
    dapo, cispo, vespo  the token sum / the active tokens of the whole step (all micro-batches, all ranks)

M = `step_micro_batches` (accumulation steps x ranks); `step_tokens` (dapo) is counted once per step over every
rank (`bigtrain.rollout.losses.global_count`). TRL's own normaliser for dapo, num_items_in_batch / processes x
accumulation / steps_per_generation, is the same number when a generation batch is one optimizer step (its
default, and with num_iterations > 1 each of its steps).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # the clipped surrogate; the others: bigtrain.rollout.losses
STEP_TOKENS = ("dapo", "cispo", "vespo")  # divided by the step's active tokens


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, *, step_micro_batches: int,
              step_tokens: float | torch.Tensor | None = None,
              max_completion_length: int | None = None) -> torch.Tensor:
    """This micro-batch's share of the step's loss (see the module's docstring)."""
    import torch
    masked = per_token * mask
    if loss_type in STEP_TOKENS:
        assert step_tokens is not None, f"{loss_type} divides by the step's active tokens: count them (global_count)"
        total = torch.as_tensor(step_tokens, dtype=masked.dtype, device=masked.device)
        return masked.sum() / total.clamp(min=1.0)
    if loss_type in ("grpo", "sapo"):
        value = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "luspo":  # each sequence weighted by its length (LUSPO)
        value = masked.sum(-1).mean()
    elif loss_type == "bnpo":
        value = masked.sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        assert max_completion_length, "dr_grpo divides by max_completion_length"
        value = masked.sum() / (mask.shape[0] * max_completion_length)
    else:
        raise ValueError(f"objective.loss_type={loss_type!r}: must be one of {', '.join(LOSS_TYPES)}")
    return value / step_micro_batches


# the settings that only some loss types read (bigtrain.rollout.losses.grpo_terms): set for another, one line
ONLY_FOR = {"delta": CLIPPED,
            **dict.fromkeys(("sapo_temperature_pos", "sapo_temperature_neg"), ("sapo",)),
            **dict.fromkeys(("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"), ("vespo",))}


def check_loss_settings(settings: Any) -> None:
    """One line for a GRPO loss setting out of its range, or set for a loss type that does not read it."""
    from dataclasses import fields
    s = settings
    defaults = {f.name: f.default for f in fields(s)}
    for name, types in ONLY_FOR.items():
        if getattr(s, name) != defaults[name] and s.loss_type not in types:
            raise ValueError(f"objective.{name}={getattr(s, name)} is read by loss_type {' / '.join(types)} only: "
                             f"objective.loss_type={s.loss_type} would ignore it; set the loss type or drop it")
    if s.delta is not None and not s.delta > 1:
        raise ValueError(f"objective.delta={s.delta}: must be > 1 (the cap on the importance ratio of the two-sided "
                         "clip; INTELLECT-2 suggests more than 1 + epsilon), or null (off)")
    for name in ("sapo_temperature_pos", "sapo_temperature_neg", "vespo_lambda_pos", "vespo_lambda_neg"):
        if not getattr(s, name) > 0:
            raise ValueError(f"objective.{name}={getattr(s, name)}: must be > 0")
    for name in ("vespo_k_pos", "vespo_k_neg"):
        if not getattr(s, name) >= 0:
            raise ValueError(f"objective.{name}={getattr(s, name)}: must be >= 0 (the power of the ratio in VESPO's "
                             "weight)")
    if not 0.0 <= s.top_entropy_quantile <= 1.0:
        raise ValueError(f"objective.top_entropy_quantile={s.top_entropy_quantile}: must be in [0, 1] (the share of "
                         "tokens by entropy that train the policy term; 1.0 keeps all, the paper suggests 0.2)")
    threshold = s.off_policy_mask_threshold
    if threshold is not None and not threshold > 0:
        raise ValueError(f"objective.off_policy_mask_threshold={threshold}: must be > 0 (a sequence's mean KL to "
                         "the policy that sampled it, e.g. 0.5), or null (off)")
    if threshold is not None and s.num_iterations == 1:
        raise ValueError(f"objective.off_policy_mask_threshold={threshold} masks sequences the policy moved away "
                         "from since sampling them, and with objective.num_iterations=1 every step trains on its "
                         "own fresh samples: set num_iterations > 1, or drop it")
