"""The losses of online RL, as TRL 1.16 computes them (grpo_trainer.py / rloo_trainer.py `_compute_loss`,
distillation_trainer.py), as pure functions of tensors.

Shapes: B completions of T tokens (right-padded), `mask` [B, T] 1 on a completion's tokens (0 on padding and,
with objective.mask_truncated_completions, on every token of a completion cut by max_completion_length).

A step's loss is split into shares: each micro-batch on each rank returns its share, and the shares of all
micro-batches on all ranks add up to the step's loss as TRL defines it (how GRPO's loss types split it:
bigtrain.objectives.loss_types). `global_count` counts a step's completion tokens over every rank (dapo's divisor).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

IMPORTANCE_LEVELS = ("token", "sequence")
Sums = dict[str, tuple[torch.Tensor, torch.Tensor]]  # metric -> (sum, count) of one micro-batch, not yet reduced


def token_logps(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(target) under softmax(logits / temperature), per position: [B, T, V], [B, T] -> [B, T] (fp32 or wider). The
    temperature is the sampling one: the ratio and the KL are of the distribution the tokens were drawn from."""
    logits = _at_least_fp32(logits) / temperature
    picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The entropy (nats) of softmax(logits / temperature) per position: [B, T, V] -> [B, T], no gradient."""
    with torch.no_grad():
        logp = torch.log_softmax(_at_least_fp32(logits) / temperature, dim=-1)
        return -(logp.exp() * logp).sum(dim=-1)


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimate of KL(pi || ref) per token: exp(ref - logp) - (ref - logp) - 1 (>= 0)."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


@dataclass
class PolicyTerms:
    """A micro-batch's per-token loss and what its metrics are read from."""

    per_token: torch.Tensor  # [B, T] ([B, 1] at sequence level without KL: broadcast against the mask)
    ratio: torch.Tensor  # the importance ratio pi / pi_old: [B, T] (token level) or [B, 1] (sequence level)
    kl: torch.Tensor | None  # the k3 KL per token [B, T] (times the ratio with the bias correction), when beta > 0


def grpo_terms(logps: torch.Tensor, old_logps: torch.Tensor | None, advantages: torch.Tensor,
               mask: torch.Tensor, *, epsilon_low: float = 0.2, epsilon_high: float | None = None,
               importance_sampling_level: str = "token", ref_logps: torch.Tensor | None = None,
               beta: float = 0.0, use_bias_correction_kl: bool = True) -> PolicyTerms:
    """GRPO's clipped surrogate per token: -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) + beta k3 KL,
    the KL multiplied by rho with `use_bias_correction_kl` (TRL's default: DeepSeek-V3.2's unbiased reverse-KL
    gradient; rho is 1 in value on-policy but not in gradient, so it changes the step even then).

    `old_logps` None: the completions were sampled by these very weights (one iteration, TRL's default), so
    rho = exp(logp - logp.detach()) = 1 in value with the gradient of logp. `advantages` [B]."""
    if importance_sampling_level not in IMPORTANCE_LEVELS:
        raise ValueError(f"objective.importance_sampling_level={importance_sampling_level!r}: must be token or "
                         "sequence")
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    old_logps = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old_logps
    if importance_sampling_level == "sequence":  # GSPO: the length-normalised sequence ratio
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    adv = advantages.unsqueeze(1)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    kl = None
    if beta != 0.0:
        assert ref_logps is not None, "beta > 0 needs the reference's log-probabilities"
        kl = k3_kl(logps, ref_logps)
        if use_bias_correction_kl:
            kl = kl * ratio
        per_token = per_token + beta * kl
    return PolicyTerms(per_token, ratio, kl)


def global_count(masks: list[torch.Tensor]) -> torch.Tensor:
    """The active tokens of a step: this rank's micro-batches' masks summed, then over every rank (fp64)."""
    count = torch.stack([m.sum() for m in masks]).sum().to(torch.float64).reshape(1)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(count)
    return count[0]


def rloo_terms(logps: torch.Tensor, old_seq_logps: torch.Tensor | None, advantages: torch.Tensor,
               mask: torch.Tensor, *, epsilon_low: float = 0.2,
               epsilon_high: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO's clipped surrogate per sequence, with the sequence-level ratio exp(sum logp - sum logp_old):
    ([B] per-sequence loss, [B] ratio). Its share of the step: the mean over the micro-batch / M."""
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    seq = (logps * mask).sum(1)
    old = seq.detach() if old_seq_logps is None else old_seq_logps
    ratio = torch.exp(seq - old)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    return -torch.min(ratio * advantages, clipped * advantages), ratio


def clip_sums(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, epsilon_low: float,
              epsilon_high: float | None = None) -> Sums:
    """TRL's clip_ratio/low_mean, high_mean, region_mean as (sum, count): the share of tokens (of sequences,
    for a ratio per sequence) whose ratio the clip held: below 1 - eps_low with A < 0, above 1 + eps_high
    with A > 0."""
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    adv = advantages.reshape(-1, *([1] * (ratio.dim() - 1)))
    low = ((ratio < 1 - epsilon_low) & (adv < 0)).float()
    high = ((ratio > 1 + epsilon_high) & (adv > 0)).float()
    region = torch.maximum(low, high)
    if ratio.dim() == 1 or ratio.shape[-1] == 1:  # one ratio per sequence: every sequence counts once
        count = torch.tensor(float(ratio.shape[0]), device=ratio.device)
        return {name: (x.sum(), count) for name, x in (("clip_ratio/low_mean", low), ("clip_ratio/high_mean", high),
                                                       ("clip_ratio/region_mean", region))}
    return {name: masked_sum(x, mask) for name, x in (("clip_ratio/low_mean", low), ("clip_ratio/high_mean", high),
                                                      ("clip_ratio/region_mean", region))}


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of values on the mask, tokens on the mask), detached: a token mean once reduced over ranks."""
    return (values.detach() * mask).sum(), mask.sum().to(values.dtype)


def distill_share(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor, *,
                  beta: float, temperature: float, step_tokens: float | torch.Tensor) -> torch.Tensor:
    """On-policy distillation: the generalized Jensen-Shannon divergence between the student's and the teacher's
    next-token distributions on the completion's tokens (beta 0: forward KL(teacher || student); 1: reverse KL,
    TRL DistillationTrainer's default), summed and divided by the step's active tokens (TRL's
    num_items_in_batch). Computed by DeepSpeed's `runtime.rollout.opsd.generalized_jsd_loss` (the same formula:
    tests/unit/test_rollout_losses.py holds it to TRL's within 1e-6). Logits [B, T, V] at the positions that
    predict the completion's tokens, `mask` [B, T]."""
    from deepspeed.runtime.rollout.opsd import generalized_jsd_loss

    out = generalized_jsd_loss(student_logits.float(), teacher_logits.float(), mask.bool(), beta=beta,
                               temperature=temperature)
    total = torch.as_tensor(step_tokens, dtype=out.loss_sum.dtype, device=out.loss_sum.device)
    return out.loss_sum / total.clamp(min=1.0)
