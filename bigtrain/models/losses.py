"""Losses shared by the model families; each takes (logits, labels) and returns a scalar."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def classification_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the batch, reduced in fp32 (stable under bf16/fp16)."""
    return F.cross_entropy(logits.float(), labels)


def lm_targets(labels: torch.Tensor, positions: int) -> torch.Tensor:
    """Next-token targets of `positions` inputs. Labels one token longer than the inputs are packed blocks
    of seq_len + 1 (bigtrain.data.blocks): every position has a target, labels[..., 1:]. Labels equal to
    the inputs are shifted left and the last position has none (-100), as in transformers."""
    if labels.shape[-1] == positions + 1:
        return labels[..., 1:]
    return F.pad(labels, (0, 1), value=-100)[..., 1:]


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over `lm_targets` (-100 ignored), from fp32 logits like
    transformers' ForCausalLMLoss."""
    targets = lm_targets(labels, logits.shape[-2])
    return F.cross_entropy(logits.float().flatten(0, -2), targets.reshape(-1), ignore_index=-100)


def answer_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the summed log-probability of its answer tokens (labels not -100, predicted from what precedes
    them) and their count, from fp32 logits (a preference objective's numbers, its reference's too)."""
    targets = lm_targets(labels, logits.shape[-2])
    token_logps = -F.cross_entropy(logits.float().flatten(0, -2), targets.reshape(-1), ignore_index=-100,
                                   reduction="none").view(targets.shape)
    mask = targets != -100
    return (token_logps * mask).sum(-1), mask.sum(-1)


def answer_logit_sums(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per row: the sum over its answer tokens of the next-token logits' mean over the vocabulary (TRL's
    logits/chosen and logits/rejected divide it by the tokens' count), without an fp32 copy of the logits or a
    graph."""
    targets = lm_targets(labels, logits.shape[-2])
    return (logits.detach().mean(-1, dtype=torch.float32) * (targets != -100)).sum(-1)


def target_count(labels: torch.Tensor) -> torch.Tensor:
    """The trained next-token targets in `labels` (those `lm_targets` does not ignore), in either layout: both
    predict labels[..., 1:]."""
    return (labels[..., 1:] != -100).sum()


def correct_counts(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[correct predictions, predictions] of a classifier's logits [B, C] against labels [B], as float64."""
    correct = (logits.argmax(dim=-1) == labels).sum()
    return torch.stack([correct, torch.tensor(labels.numel(), device=labels.device)]).to(torch.float64)
