"""An export checks itself: what was written is loaded back the way a user would load it
(`bigtrain.export.read`: `from_pretrained` for a Hugging Face directory, `load_exported` otherwise), a fixed batch runs
through the model that was written and through the reloaded one, and the largest logit
difference is reported. Both are fp32 on CPU with the same kernels, so anything but 0 means
the directory does not hold the trained model (a dropped tied weight, a renamed key, a config
that builds another architecture).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bigtrain.models import ModelSpec, call_module, output_logits

BATCH, TOKENS = 2, 16


def fixed_batch(spec: ModelSpec) -> Any:
    """Inputs the model takes, the same every time: tokens (a padded second text for classifiers) or images."""
    if spec.fixed_inputs is not None:
        return spec.fixed_inputs()
    gen = torch.Generator().manual_seed(0)
    if spec.modality == "image":
        size = spec.image_size
        return torch.randn(BATCH, 3, size, size, generator=gen)
    vocab = spec.vocab_size or spec.config.vocab_size
    tokens = min(TOKENS, spec.seq_len or TOKENS)
    ids = torch.randint(0, vocab, (BATCH, tokens), generator=gen)
    if spec.modality == "classify":
        mask = torch.ones_like(ids)
        mask[1, tokens // 2:] = 0
        return {"input_ids": ids, "attention_mask": mask}
    return ids


def largest_logit_difference(written: nn.Module, reloaded: nn.Module, spec: ModelSpec) -> float:
    """max |logits(written) - logits(reloaded)| on `fixed_batch(spec)`, both in eval mode."""
    return compare_logits(fixed_logits(written, spec), fixed_logits(reloaded, spec))


@torch.no_grad()
def fixed_logits(model: nn.Module, spec: ModelSpec) -> torch.Tensor:
    """The model's fp32 logits on `fixed_batch(spec)`, in eval mode."""
    return output_logits(call_module(model.eval(), fixed_batch(spec))).float()


def compare_logits(trained: torch.Tensor, reloaded: torch.Tensor) -> float:
    """max |trained - reloaded|; ValueError when they cannot be the same model or the trained ones overflow."""
    if trained.shape != reloaded.shape:
        raise ValueError(f"the reloaded export gives logits of shape {tuple(reloaded.shape)}, the trained model "
                         f"{tuple(trained.shape)}: the directory builds another model")
    if not bool(torch.isfinite(trained).all()):
        raise ValueError("the checkpoint's model gives non-finite logits on a fixed batch (its weights overflow): "
                         "its run diverged before this save; export an earlier checkpoint with --tag")
    return float((trained - reloaded).abs().max())
