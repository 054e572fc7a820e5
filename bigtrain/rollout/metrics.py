"""What a GRPO / RLOO step reports, under TRL 1.16's names (so that a user's dashboards and habits carry over):

    reward, reward_std                 the weighted reward's mean and std over the scorable completions
    rewards/<function>/mean|std        each reward function's own, over the completions it scored
    frac_reward_zero_std               the share of completions whose group's rewards were all alike: no signal
    completions/mean_length|min_length|max_length, completions/clipped_ratio (cut by max_completion_length)
    kl, entropy, clip_ratio/low_mean|high_mean|region_mean   from the loss (bigtrain.rollout.losses' Sums)
    what the reward functions logged with log_metric      each name's mean over every value of every rank

The reward and completion metrics come from the global batch's tensors (gathered for the advantages anyway);
the loss's come as (sum, count) pairs per micro-batch, reduced over ranks in one all-reduce (`reduce_sums`).
TRL logs the mean of those per-micro-batch values over the logging window; so does the stepper.
"""
from __future__ import annotations

import torch

from bigtrain.rollout.advantages import nanstd
from bigtrain.rollout.losses import Sums


def _item(x: torch.Tensor) -> float:
    return float(x)


def reward_metrics(per_function: torch.Tensor, names: list[str], weights: torch.Tensor | None,
                   std_zero: torch.Tensor) -> dict[str, float]:
    """[N, F] scores (NaN: None) of the global batch, the functions' names, their weights, and the advantages'
    std-zero flags -> TRL's reward metrics."""
    from bigtrain.rollout.advantages import combine_rewards
    assert per_function.shape[1] == len(names), (per_function.shape, names)
    out: dict[str, float] = {}
    for i, name in enumerate(names):
        out[f"rewards/{name}/mean"] = _item(torch.nanmean(per_function[:, i]))
        out[f"rewards/{name}/std"] = _item(nanstd(per_function[:, i]))
    rewards = combine_rewards(per_function, weights)
    out["reward"] = _item(torch.nanmean(rewards))
    out["reward_std"] = _item(nanstd(rewards))
    out["frac_reward_zero_std"] = _item(std_zero.float().mean())
    return out


def completion_metrics(lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
    """The global batch's completion lengths (tokens, the end-of-text included) and which were cut by
    max_completion_length (no end-of-text) -> TRL's completions/* metrics."""
    lengths = lengths.float()
    return {"completions/mean_length": _item(lengths.mean()), "completions/min_length": _item(lengths.min()),
            "completions/max_length": _item(lengths.max()),
            "completions/clipped_ratio": _item(truncated.float().mean())}


def reduce_sums(sums: Sums) -> dict[str, float]:
    """(sum, count) per metric of this rank's micro-batch -> the mean over every rank's, in one all-reduce."""
    names = sorted(sums)
    if not names:
        return {}
    flat = torch.stack([torch.stack([sums[n][0].double(), sums[n][1].double()]) for n in names])
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(flat)
    return {n: _item(flat[i, 0] / flat[i, 1].clamp(min=1.0)) for i, n in enumerate(names)}


def logged_metrics(logged: dict[str, list[float]], device: torch.device | str) -> dict[str, float]:
    """What this rank's reward functions logged with log_metric in a round -> each name's mean over every value
    every rank logged (TRL's). A collective: the names are gathered first (a rank may log what another does not)."""
    names = set(logged)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        everyone: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, sorted(names))
        names = {name for theirs in everyone for name in theirs}
    sums = {name: (torch.tensor(sum(logged.get(name, [])), dtype=torch.float64, device=device),
                   torch.tensor(float(len(logged.get(name, []))), dtype=torch.float64, device=device))
            for name in names}
    return reduce_sums(sums)
