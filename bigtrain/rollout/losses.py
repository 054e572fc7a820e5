"""The losses of online RL, as TRL 1.16 computes them (grpo_trainer.py / rloo_trainer.py `_compute_loss`,
distillation_trainer.py), as pure functions of tensors.

Shapes: B completions of T tokens (right-padded), `mask` [B, T] 1 on a completion's tokens (0 on padding and,
with objective.mask_truncated_completions, on every token of a completion cut by max_completion_length).

A step's loss is split into shares: each micro-batch on each rank returns its share, and the shares of all
micro-batches on all ranks add up to the step's loss as TRL defines it (how GRPO's loss types split it:
bigtrain.objectives.loss_types). `global_count` counts a step's completion tokens over every rank (dapo's divisor).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

IMPORTANCE_LEVELS = ("token", "sequence")
Sums = dict[str, tuple[torch.Tensor, torch.Tensor]]  # metric -> (sum, count) of one micro-batch, not yet reduced


def token_logps(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(target) under softmax(logits / temperature), per position: [B, T, V], [B, T] -> [B, T] (fp32 or wider). The
    temperature is the sampling one: the ratio and the KL are of the distribution the tokens were drawn from. Chunk by
    chunk of positions, no fp32 copy of the whole logits (bigtrain.rollout.chunked_logps)."""
    from bigtrain.rollout.chunked_logps import chunked_token_logps
    return chunked_token_logps(logits, targets, temperature)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The entropy (nats) of softmax(logits / temperature) per position: [B, T, V] -> [B, T], no gradient (chunked)."""
    from bigtrain.rollout.chunked_logps import chunked_token_entropy
    return chunked_token_entropy(logits, temperature)


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimate of KL(pi || ref) per token: exp(ref - logp) - (ref - logp) - 1 (>= 0)."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


OWN_TERMS = ("cispo", "sapo", "vespo")  # the loss types with a per-token form of their own; the others clip
# (their list, with the aggregation of each: bigtrain.objectives.loss_types)


@dataclass(frozen=True)
class GRPOLoss:
    """How GRPO's per-token loss is formed: the objective's settings of these names (TRL 1.16's GRPOConfig's, with
    its defaults; `of` reads them from the settings)."""

    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: epsilon
    importance_sampling_level: str = "token"
    beta: float = 0.0
    use_bias_correction_kl: bool = True
    delta: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_mask_threshold: float | None = None
    top_entropy_quantile: float = 1.0

    @classmethod
    def of(cls, settings: object) -> GRPOLoss:
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)})

    @property
    def high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass
class PolicyTerms:
    """A micro-batch's per-token loss and what its metrics are read from."""

    per_token: torch.Tensor  # [B, T] ([B, 1] at sequence level without KL: broadcast against the mask)
    ratio: torch.Tensor  # the importance ratio pi / pi_old: [B, T] (token level) or [B, 1] (sequence level)
    kl: torch.Tensor | None  # the k3 KL per token [B, T] (times the ratio with the bias correction), when beta > 0
    phi: torch.Tensor | None = None  # vespo: each sequence's gamma weight [B, 1]


def grpo_terms(logps: torch.Tensor, old_logps: torch.Tensor | None, advantages: torch.Tensor,
               mask: torch.Tensor, loss: GRPOLoss = GRPOLoss(), *, ref_logps: torch.Tensor | None = None,
               entropies: torch.Tensor | None = None) -> PolicyTerms:
    """GRPO's per-token loss as `loss.loss_type` forms it (TRL's `_compute_loss`), rho the importance ratio:

        clipped (grpo, bnpo, dr_grpo, dapo, luspo)  -min(rho' A, clip(rho, 1 - epsilon, 1 + epsilon_high) A),
                                                    rho' = min(rho, delta) with delta (INTELLECT-2's two-sided clip)
        cispo   -min(rho, epsilon_high) A log pi, the weight without gradient (MiniMax-M1)
        sapo    -sigmoid(tau (rho - 1)) 4 / tau A, tau sapo_temperature_pos for A > 0, else _neg
        vespo   -phi(w) A log pi, phi VESPO's gamma weight of the sequence's ratio (bigtrain.rollout.loss_weights)

    then masked by off_policy_mask_threshold and top_entropy_quantile (`entropies` [B, T]: the policy's, needed
    then), plus beta k3 KL to the reference, multiplied by rho with use_bias_correction_kl (DeepSeek-V3.2's
    unbiased reverse-KL gradient; rho is 1 in value on-policy but not in gradient, so it changes the step even
    then). rho is per token, or per sequence (importance_sampling_level: the mean of its log-ratios, GSPO).

    `old_logps` None: the completions were sampled by these very weights (one iteration, TRL's default), so
    rho = exp(logp - logp.detach()) = 1 in value with the gradient of logp. `advantages` [B]."""
    from bigtrain.rollout.loss_weights import high_entropy_mask, off_policy_mask
    if loss.importance_sampling_level not in IMPORTANCE_LEVELS:
        raise ValueError(f"objective.importance_sampling_level={loss.importance_sampling_level!r}: must be token or "
                         "sequence")
    adv = advantages.unsqueeze(1)
    old_logps = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old_logps
    weights = log_ratio
    if loss.importance_sampling_level == "sequence":  # GSPO: the length-normalised sequence ratio
        weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(weights)
    kl = None
    if loss.beta != 0.0:
        assert ref_logps is not None, "beta > 0 needs the reference's log-probabilities"
        kl = k3_kl(logps, ref_logps)
        if loss.use_bias_correction_kl:
            kl = kl * ratio
    terms = _policy_term(logps, log_ratio, ratio, adv, mask, loss)
    if loss.off_policy_mask_threshold is not None:
        terms.per_token = terms.per_token * off_policy_mask(adv, logps, old_logps, mask,
                                                            loss.off_policy_mask_threshold)
    if loss.top_entropy_quantile < 1.0:
        assert entropies is not None, "top_entropy_quantile < 1 needs the policy's token entropies"
        terms.per_token = terms.per_token * high_entropy_mask(entropies, mask, 1 - loss.top_entropy_quantile)
    if kl is not None:
        terms.per_token = terms.per_token + loss.beta * kl
        terms.kl = kl
    return terms


def _policy_term(logps: torch.Tensor, log_ratio: torch.Tensor, ratio: torch.Tensor, adv: torch.Tensor,
                 mask: torch.Tensor, loss: GRPOLoss) -> PolicyTerms:
    """The policy part of the per-token loss by loss type (see `grpo_terms`), and the ratio its metrics read."""
    from bigtrain.rollout.loss_weights import gamma_weights
    phi = None
    if loss.loss_type not in OWN_TERMS:
        clipped = torch.clamp(ratio, 1 - loss.epsilon, 1 + loss.high)
        if loss.delta is not None:
            ratio = torch.clamp(ratio, max=loss.delta)
        per_token = -torch.min(ratio * adv, clipped * adv)
    elif loss.loss_type == "cispo":
        per_token = -torch.clamp(ratio, max=loss.high).detach() * adv * logps
    elif loss.loss_type == "sapo":
        tau = torch.where(adv > 0, loss.sapo_temperature_pos, loss.sapo_temperature_neg)
        per_token = -(torch.sigmoid(tau * (ratio - 1)) * 4 / tau) * adv
    else:  # vespo: the sequence's ratio is its own, the sum of the per-token log-ratios
        phi = gamma_weights(adv, log_ratio, mask, k_pos=loss.vespo_k_pos, lambda_pos=loss.vespo_lambda_pos,
                            k_neg=loss.vespo_k_neg, lambda_neg=loss.vespo_lambda_neg)
        per_token = -phi * adv * logps
    return PolicyTerms(per_token, ratio, None, phi)


def loss_sums(terms: PolicyTerms, advantages: torch.Tensor, mask: torch.Tensor, loss: GRPOLoss) -> Sums:
    """The loss type's own metrics (TRL's names) as (sum, count): clip_ratio/* for the clipped ones,
    cispo_clip_ratio (the share of tokens whose weight the cap held, A > 0), vespo/phi_seq_mean; sapo has none."""
    if loss.loss_type not in OWN_TERMS:
        return clip_sums(terms.ratio, advantages, mask, loss.epsilon, loss.high)
    if loss.loss_type == "cispo":
        held = ((terms.ratio > loss.high) & (advantages.unsqueeze(1) > 0)).float()
        return {"cispo_clip_ratio": mean_sums(held, mask)}
    if loss.loss_type == "vespo":
        return {"vespo/phi_seq_mean": mean_sums(terms.phi, mask)}
    return {}


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
    return {name: mean_sums(x, mask) for name, x in (("clip_ratio/low_mean", low), ("clip_ratio/high_mean", high),
                                                     ("clip_ratio/region_mean", region))}


def mean_sums(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's global_masked_mean as (sum, count): over the mask's tokens, or, for one value per sequence ([B] or
    [B, 1]), over the sequences."""
    if values.dim() == 1 or values.shape[-1] == 1:
        return values.detach().sum(), torch.tensor(float(values.shape[0]), device=values.device)
    return masked_sum(values, mask)


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
