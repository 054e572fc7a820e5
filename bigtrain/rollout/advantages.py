"""From rewards to advantages, as TRL 1.16's GRPOTrainer and RLOOTrainer compute them (their
`_generate_and_score_completions`), on the rewards of the whole global batch.

The completions arrive grouped: rows g*G .. g*G + G - 1 are the G answers to prompt g (`group_size` G =
objective.num_generations). Every function here takes the global batch's tensors (each rank's rewards gathered:
a group's mean and a batch's std need them all) and is pure: no process group, no model.

- `combine_rewards`: each reward function's score (NaN where it returned None) times its weight, summed; NaN
  where every function returned None: such a completion is unscorable, left out of its group's mean and std,
  and gets advantage 0 (TRL's rule).
- `group_advantages` (GRPO): reward minus its group's mean, divided by the std (of the group, of the whole
  batch, or not at all: objective.scale_rewards group | batch | none) + 1e-4.
- `rloo_advantages` (RLOO): reward minus the mean of the other scorable answers to the same prompt, optionally
  normalised over the batch; `kl_penalised_rewards` first subtracts beta times each completion's summed k1 KL
  to the reference (RLOO's KL is a reward penalty, not a loss term).
"""
from __future__ import annotations

import torch

SCALE_REWARDS = ("group", "batch", "none")
STD_EPS = 1e-4  # TRL adds it to every std it divides by


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation ignoring NaNs, with Bessel's correction; NaN for fewer than 2 values (TRL's
    `trainer.utils.nanstd`). Over every value, or along `dim` (which goes)."""
    if dim is None:
        values, dim = values.reshape(-1), 0
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim)
    count = (~torch.isnan(values)).sum(dim=dim)
    return torch.where(count > 1, torch.sqrt(variance * count / (count - 1).clamp(min=1)),
                       torch.full_like(variance, float("nan")))


def combine_rewards(per_function: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """[N, F] scores (NaN = the function returned None) -> [N] weighted sums; NaN where all F are NaN."""
    assert per_function.dim() == 2, per_function.shape
    if weights is None:
        weights = torch.ones(per_function.shape[1], dtype=per_function.dtype, device=per_function.device)
    rewards = (per_function * weights.to(per_function).unsqueeze(0)).nansum(dim=1)
    return rewards.masked_fill(torch.isnan(per_function).all(dim=1), float("nan"))


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    assert rewards.dim() == 1, rewards.shape
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} completions are not whole groups of objective.num_generations="
                         f"{group_size}: make the global batch a multiple of num_generations")
    return rewards.view(-1, group_size)


def group_advantages(rewards: torch.Tensor, group_size: int,
                     scale_rewards: str = "group") -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO's advantages of [N] rewards (NaN: unscorable) in groups of `group_size`, and whether each
    completion's std was zero (TRL's `frac_reward_zero_std` is its mean): (advantages [N], std_zero [N])."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"objective.scale_rewards={scale_rewards!r}: must be one of {', '.join(SCALE_REWARDS)}")
    grouped = _groups(rewards, group_size)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group_size)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    elif group_size > 1:  # group, and none (whose std only says whether a group's rewards were all alike)
        std = nanstd(grouped, dim=1).repeat_interleave(group_size)
    else:
        std = torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPS)
    return torch.nan_to_num(advantages, nan=0.0), torch.isclose(std, torch.zeros_like(std))


def kl_penalised_rewards(rewards: torch.Tensor, old_logps: torch.Tensor, ref_logps: torch.Tensor,
                         mask: torch.Tensor, beta: float) -> torch.Tensor:
    """RLOO: each reward less beta x its completion's summed k1 estimate (log pi_old - log pi_ref per token);
    [N], [N, T], [N, T], [N, T] -> [N]."""
    if beta == 0.0:
        return rewards
    return rewards - beta * ((old_logps - ref_logps) * mask).sum(dim=-1)


def rloo_advantages(rewards: torch.Tensor, group_size: int, normalize: bool = False) -> tuple[torch.Tensor,
                                                                                                torch.Tensor]:
    """RLOO's leave-one-out advantages of [N] rewards in groups: r_i minus the mean of the group's other scorable
    rewards (0 for a completion with no scorable sibling, or unscorable itself), then normalised over the batch
    when `normalize` (objective.normalize_advantages). Returns (advantages [N], std_zero [N // group_size])."""
    grouped = _groups(rewards, group_size)
    std = nanstd(grouped, dim=1) if group_size > 1 else torch.zeros(grouped.shape[0], dtype=rewards.dtype,
                                                                     device=rewards.device)
    if group_size > 1:
        scorable = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
        baselines = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (scorable - 1)
        advantages = rewards - baselines.view(-1)
    else:
        advantages = torch.zeros_like(rewards)
    if normalize:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + STD_EPS)
    return torch.nan_to_num(advantages, nan=0.0), torch.isclose(std, torch.zeros_like(std))
