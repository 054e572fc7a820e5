"""A completion's per-token log-probabilities and entropies from its logits, a chunk of positions at a time.

`log p(target)` under softmax(logits / temperature) over a [B, T, V] logits tensor, done whole, makes an fp32 copy
of the logits divided by the temperature (which autograd keeps for the backward pass) and as large a temporary
inside the log-sum-exp; the entropy makes two more. Here the positions go through in chunks of `chunk_rows`: the
fp32 work of one chunk is alive at a time, the forward keeps only each position's log-sum-exp, and the backward
recomputes a chunk's softmax to form its gradient (onehot(target) - softmax) / temperature, written into one
gradient of the logits' own size and dtype. The same numbers as the whole computation (tests/unit/
test_chunked_logps.py holds them within 1e-6, gradients included); what it saves is memory (docs/online-rl.md).
"""
from __future__ import annotations

from typing import Any

import torch

from bigtrain.models.chunked_loss import default_chunk_rows


def chunked_token_logps(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                        chunk_rows: int | None = None) -> torch.Tensor:
    """[B, T, V], [B, T] -> [B, T] fp32 (or wider) log p(target), `chunk_rows` positions (default: about 256 MiB of
    fp32 logits) at a time."""
    rows = chunk_rows or default_chunk_rows(logits.shape[-1])
    return _TokenLogps.apply(logits, targets, temperature, rows)


def chunked_token_entropy(logits: torch.Tensor, temperature: float = 1.0, chunk_rows: int | None = None) -> torch.Tensor:
    """The entropy (nats) of softmax(logits / temperature) per position, chunk by chunk, without a gradient."""
    rows = chunk_rows or default_chunk_rows(logits.shape[-1])
    flat = logits.detach().reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=_wide(logits.dtype), device=logits.device)
    with torch.no_grad():
        for start in range(0, flat.shape[0], rows):
            logp = torch.log_softmax(flat[start:start + rows].to(out.dtype) / temperature, dim=-1)
            out[start:start + rows] = -(logp.exp() * logp).sum(dim=-1)
    return out.view(logits.shape[:-1])


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class _TokenLogps(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                rows: int) -> torch.Tensor:
        flat, picks = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1, 1)
        wide = _wide(logits.dtype)
        lse = torch.empty(flat.shape[0], dtype=wide, device=logits.device)
        out = torch.empty_like(lse)
        for start in range(0, flat.shape[0], rows):
            x = flat[start:start + rows].to(wide) / temperature
            lse[start:start + rows] = torch.logsumexp(x, dim=-1)
            out[start:start + rows] = x.gather(-1, picks[start:start + rows]).squeeze(-1) - lse[start:start + rows]
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature, ctx.rows = temperature, rows
        return out.view(targets.shape)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        logits, targets, lse = ctx.saved_tensors
        flat, picks = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1, 1)
        grad = grad_out.reshape(-1, 1).to(lse.dtype)
        grad_logits = torch.empty_like(flat)
        for start in range(0, flat.shape[0], ctx.rows):
            part = slice(start, start + ctx.rows)
            soft = torch.exp(flat[part].to(lse.dtype) / ctx.temperature - lse[part].unsqueeze(1))
            chunk = soft.mul_(-grad[part]).scatter_add_(-1, picks[part], grad[part])
            grad_logits[part] = chunk.div_(ctx.temperature).to(flat.dtype)
        return grad_logits.view(logits.shape), None, None, None
