"""What TRL 1.16's GRPOTrainer multiplies a token's loss by besides the importance ratio (grpo_trainer.py
`get_off_policy_mask`, `get_high_entropy_mask`, `get_gamma_weights`), as functions of tensors:

    off_policy_mask    objective.off_policy_mask_threshold (DeepSeek-V3.2's off-policy sequence masking): a
                       sequence with a negative advantage whose policy moved away from the one that sampled it
                       (mean per-token log pi_old - log pi above the threshold) is left out of the loss
    high_entropy_mask  objective.top_entropy_quantile (Beyond the 80/20 Rule): only the tokens whose entropy is in
                       the top quantile of the micro-batch's, over every rank, train the policy term
    gamma_weights      loss_type=vespo: a smooth weight of the sequence's ratio w, phi(w) = e^lambda w^k
                       e^(-lambda w) (1 at w = 1), without gradient

Shapes: `mask` [B, T] (1 on a completion's tokens), `advantages` [B, 1].
"""
from __future__ import annotations

import math

import torch


def off_policy_mask(advantages: torch.Tensor, logps: torch.Tensor, sampling_logps: torch.Tensor,
                    mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """[B, 1] in mask's dtype: 1 keeps the sequence (advantage >= 0, or its mean forward KL to the sampling
    policy <= threshold), 0 drops it."""
    kl = torch.nan_to_num(sampling_logps - logps.detach(), nan=0.0)  # a token nobody scored is no evidence
    mean_kl = (kl * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return ((advantages >= 0) | (mean_kl <= threshold)).to(dtype=mask.dtype)


def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """[B, T] bool: the completion tokens whose entropy is at least the `quantile` quantile (0.8 for
    top_entropy_quantile 0.2) of every rank's completion tokens in this micro-batch (a collective: every rank
    calls it together)."""
    everyone = _gather_varying(entropies[mask.bool()].float())
    if everyone.numel() == 0:
        return torch.zeros_like(entropies, dtype=torch.bool)
    threshold = torch.quantile(everyone, quantile)
    return ((entropies * mask.float()) >= threshold) & mask.bool()


@torch.no_grad()
def gamma_weights(advantages: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor, *, k_pos: float,
                  lambda_pos: float, k_neg: float, lambda_neg: float) -> torch.Tensor:
    """VESPO's phi(w) per sequence, [B, 1]: w = exp(the sum of its per-token log-ratios), k and lambda by the
    advantage's sign (>= 0: the _pos pair), computed in log space and clamped as TRL does."""
    lower = math.log(1e-8)
    seq_log_ratio = torch.sum(torch.clamp(log_ratio, -20.0, 20.0) * mask, dim=-1, keepdim=True)
    log_w = torch.clamp(seq_log_ratio, lower, 20.0)
    nonnegative = advantages >= 0
    k = torch.where(nonnegative, k_pos, k_neg)
    lam = torch.where(nonnegative, lambda_pos, lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _gather_varying(local: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor of each rank's own length, every rank's concatenated in rank order."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return local
    world = torch.distributed.get_world_size()
    size = torch.tensor([local.numel()], device=local.device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    torch.distributed.all_gather(sizes, size)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=local.dtype, device=local.device)
    padded[:local.numel()] = local
    parts = [torch.empty_like(padded) for _ in range(world)]
    torch.distributed.all_gather(parts, padded)
    return torch.cat([part[:int(n.item())] for part, n in zip(parts, sizes)])
