"""Causal-LM cross-entropy computed from the hidden states and the output head, chunk by chunk.

The plain loss (`losses.causal_lm_loss`) takes the module's logits: a [tokens, vocabulary] tensor in
the compute dtype, then an fp32 copy of it, and in the backward pass two more fp32 tensors of that size.
For GPT-2 small at 16 x 1024 tokens that is 16384 x 50304 x 4 bytes = 3.3 GB per fp32 copy
(docs/benchmarks.md, "On a GPU"). Here the head's matmul runs on `chunk_rows` tokens at a time:
each chunk's logits (compute dtype, then fp32 for the log-sum-exp) live only while that chunk is
processed, and the chunk's gradients with respect to the hidden states and the head weight are
computed right there (the fused linear cross-entropy of Liger-Kernel), so the backward pass only
scales them by the incoming gradient: no logits are kept, none are recomputed, and the head costs
the same three matmuls as in the plain path.

Same math as `F.cross_entropy(logits.float(), targets, ignore_index=-100)` on `hidden @ weight.T`:
fp32 log-sum-exp, mean over the targets that are not ignored (NaN when all are, as there), the
gradient of the logits formed in fp32 and cast to the compute dtype before the matmuls, as the
plain backward does. The head-weight gradient is summed over chunks in fp32.

Nothing here imports deepspeed. Under ZeRO-3 the caller computes this inside the module's forward,
where the head weight is gathered (`bigtrain.train.engine` does).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100
# A chunk's fp32 logits take about this many elements (256 MiB), whatever the vocabulary: 1334 rows
# of GPT-2's 50304, enough for the head's matmul to run at full rate on a GPU.
CHUNK_ELEMENTS = 1 << 26


def default_chunk_rows(vocab_size: int) -> int:
    """Tokens per chunk: about CHUNK_ELEMENTS fp32 logits, a multiple of 64 (at least 64)."""
    return max(64, (CHUNK_ELEMENTS // max(vocab_size, 1)) // 64 * 64)


class _LinearCrossEntropy(torch.autograd.Function):
    """Sum of per-token losses of `hidden @ weight.T (+ bias)` against `targets`, scaled by `scale`;
    gradients are computed in forward (chunk by chunk) and only rescaled in backward."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, scale: torch.Tensor, chunk_rows: int,
                need_grads: bool) -> torch.Tensor:
        grads = _GradBuffers(hidden, weight, bias) if need_grads else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_rows):
            end = min(start + chunk_rows, hidden.shape[0])
            total = total + _chunk(hidden[start:end], weight, bias, targets[start:end], scale,
                                   grads, start, end)
        if grads is not None:
            ctx.save_for_backward(grads.hidden, grads.weight, grads.bias)
        ctx.made_grads = grads is not None
        ctx.weight_dtype, ctx.bias_dtype = weight.dtype, None if bias is None else bias.dtype
        return total * scale

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        if torch.is_grad_enabled():
            raise RuntimeError("the chunked cross-entropy has no second derivative (create_graph=True)")
        if not ctx.made_grads:
            raise RuntimeError("the chunked cross-entropy ran without gradients (no_grad or frozen inputs)")
        if getattr(ctx, "done", False):
            raise RuntimeError("the chunked cross-entropy's backward runs once (its gradients are scaled in place)")
        ctx.done = True
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        g = grad_out.float()
        # scaled in place: the buffers die with this call, and a copy would be a second [vocabulary, hidden] in fp32
        dh = None if grad_hidden is None else grad_hidden.mul_(g.to(grad_hidden.dtype))
        dw = None if grad_weight is None else grad_weight.mul_(g).to(ctx.weight_dtype)
        db = None if grad_bias is None else grad_bias.mul_(g).to(ctx.bias_dtype)
        return dh, dw, db, None, None, None, None


class _GradBuffers:
    """Where the chunks put their gradients, for what needs one: d hidden in the compute dtype, d weight (and bias)
    in fp32. A frozen head (LoRA's) gets none: no [vocabulary, hidden] buffer, no matmul for it."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        self.hidden = torch.empty_like(hidden) if hidden.requires_grad else None
        self.weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if weight.requires_grad else None
        self.bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) \
            if bias is not None and bias.requires_grad else None


def _chunk(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
           scale: torch.Tensor, grads: _GradBuffers | None, start: int, end: int) -> torch.Tensor:
    """This chunk's summed loss; with `grads`, its gradients (already multiplied by `scale`) added in."""
    logits = F.linear(h, weight, bias).float()
    valid = targets != IGNORE_INDEX
    safe = torch.where(valid, targets, torch.zeros_like(targets)).unsqueeze(-1)
    lse = torch.logsumexp(logits, dim=-1)
    loss = torch.where(valid, lse - logits.gather(-1, safe).squeeze(-1), torch.zeros_like(lse)).sum()
    if grads is None:
        return loss
    # d loss_i / d logit_ij = softmax_ij - [j == target_i]; zero for ignored rows; times the mean's scale.
    probs = logits.sub_(lse.unsqueeze(-1)).exp_()
    probs.scatter_add_(-1, safe, torch.full_like(lse, -1.0).unsqueeze(-1))
    probs.mul_((valid.float() * scale).unsqueeze(-1))
    d_logits = probs.to(h.dtype)
    if grads.hidden is not None:
        grads.hidden[start:end] = d_logits @ weight.to(h.dtype)
    if grads.weight is not None:  # summed in fp32, cast as it is added (no fp32 copy of the chunk's product)
        grads.weight.add_(d_logits.t() @ h)
    if grads.bias is not None:
        grads.bias.add_(probs.sum(0))
    return loss


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         bias: torch.Tensor | None = None, chunk_rows: int | None = None,
                         reduction: str = "mean") -> torch.Tensor:
    """Mean (or, `reduction="sum"`, summed) cross-entropy of `hidden @ weight.T + bias` ([rows, hidden] x [vocab,
    hidden]) against `targets` ([rows], -100 ignored), without a [rows, vocab] tensor larger than one chunk."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1] or weight.dim() != 2 \
            or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"linear_cross_entropy: expected hidden [rows, h], weight [vocab, h], targets [rows]; got "
                         f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(targets.shape)}")
    rows = chunk_rows or default_chunk_rows(weight.shape[0])
    if rows < 1:
        raise ValueError(f"linear_cross_entropy: chunk_rows={chunk_rows} must be >= 1")
    targets = targets.to(hidden.device)
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy: reduction={reduction!r}: mean or sum")
    count = (targets != IGNORE_INDEX).sum().float()
    scale = 1.0 / count if reduction == "mean" else torch.ones_like(count)  # a device tensor: no host sync
    need_grads = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias))
    return _LinearCrossEntropy.apply(hidden.contiguous(), weight, bias, targets, scale, rows, need_grads)


def causal_lm_chunked_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                           bias: torch.Tensor | None = None, chunk_rows: int | None = None,
                           reduction: str = "mean") -> torch.Tensor:
    """`losses.causal_lm_loss(hidden @ weight.T + bias, labels)` from the last hidden states [B, T, h]:
    targets as `losses.lm_targets` makes them (packed seq_len + 1 blocks, or labels equal to the inputs)."""
    from bigtrain.models.losses import lm_targets
    targets = lm_targets(labels, hidden.shape[-2])
    return linear_cross_entropy(hidden.flatten(0, -2), weight, targets.reshape(-1), bias, chunk_rows, reduction)


# -- which modules it applies to -----------------------------------------------------------------

# Configs whose models do more to the logits than `hidden @ head.T + bias`: the chunked loss would differ.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale", "logits_scaling")


def unsupported_reason(module: nn.Module) -> str | None:
    """None when `module` is a transformers causal LM whose logits are `head(base_model(x)[0])` with a
    plain linear head; else why the chunked loss cannot stand in for its logits."""
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear) or not hasattr(module, "base_model") or module.base_model is module:
        return f"{type(module).__name__} is not a transformers causal LM with a linear output head"
    config = getattr(module, "config", None)
    for key in _LOGIT_TRANSFORMS:
        if getattr(config, key, None) not in (None, 1, 1.0):
            return f"{type(module).__name__} transforms its logits ({key}={getattr(config, key)})"
    return None


def causal_lm_hidden_loss(module: nn.Module, args: tuple, kwargs: dict, labels: torch.Tensor,
                          chunk_rows: int | None = None, reduction: str = "mean") -> torch.Tensor:
    """The module's next-token loss on the inputs its forward takes (`args`, `kwargs`): the base model's
    last hidden states, then the output head applied chunk by chunk."""
    output = module.base_model(*args, **kwargs)
    hidden = output[0] if isinstance(output, (tuple, list)) else output.last_hidden_state
    head = module.get_output_embeddings()
    return causal_lm_chunked_loss(hidden, head.weight, labels, head.bias, chunk_rows, reduction)
