"""Losses shared by the model families; each takes (logits, labels) and returns a scalar."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def classification_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the batch, reduced in fp32 (stable under bf16/fp16)."""
    return F.cross_entropy(logits.float(), labels)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; labels equal the inputs and are shifted here (-100 ignored).

    Same as transformers' ForCausalLMLoss: fp32 logits, the last position has no target.
    """
    targets = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(logits.float().flatten(0, -2), targets.reshape(-1), ignore_index=-100)
