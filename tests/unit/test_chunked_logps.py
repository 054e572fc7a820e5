"""A completion's log-probabilities and entropies chunk by chunk (bigtrain/rollout/chunked_logps.py, what
rollout.losses.token_logps / token_entropy use): the same numbers and gradients as the whole computation within 1e-6
(fp32 and bf16 logits, a temperature, chunks that do not divide the positions), and the memory it saves measured
tensor by tensor (bigtrain.estimate.live_bytes)."""
from __future__ import annotations

import pytest
import torch

from bigtrain.estimate.live_bytes import LiveBytes
from bigtrain.rollout.chunked_logps import chunked_token_entropy, chunked_token_logps
from bigtrain.rollout.losses import token_entropy, token_logps

TEMPERATURE = 0.7


def whole_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) over the whole [B, T, V] at once (what token_logps computed before it was chunked)."""
    x = logits.float() / TEMPERATURE
    return x.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, dim=-1)


def whole_entropy(logits: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logp = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)
        return -(logp.exp() * logp).sum(dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logps_entropy_and_gradient_equal_the_whole_computation(dtype):
    g = torch.Generator().manual_seed(0)
    base = (3 * torch.randn(3, 7, 50, generator=g)).to(dtype)
    targets = torch.randint(0, 50, (3, 7), generator=g)
    weights = torch.randn(3, 7, generator=g)
    results = []
    for logps in (lambda x: whole_logps(x, targets), lambda x: chunked_token_logps(x, targets, TEMPERATURE, 5)):
        logits = base.clone().requires_grad_(True)
        values = logps(logits)
        (values * weights).sum().backward()
        results.append((values.detach(), logits.grad))
    (a, grad_a), (b, grad_b) = results
    assert b.dtype == torch.float32 and grad_b.dtype == dtype
    assert torch.allclose(a, b, atol=1e-6, rtol=0) and torch.allclose(grad_a.float(), grad_b.float(), atol=1e-6, rtol=0)
    assert torch.allclose(whole_entropy(base), chunked_token_entropy(base, TEMPERATURE, 5), atol=1e-6, rtol=0)
    assert torch.equal(token_logps(base, targets, TEMPERATURE), chunked_token_logps(base, targets, TEMPERATURE))


def test_chunks_hold_a_fraction_of_what_the_whole_computation_holds():
    """Log-probs, entropy and the backward of [4, 64, 8192] logits: the whole computation peaks at 4 fp32 copies of
    them (the scaled copy autograd keeps, the log-sum-exp's and log-softmax's temporaries, their gradient); chunked,
    at their gradient (the logits' own size) and one chunk's work."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 64, 8192, generator=g)
    targets = torch.randint(0, 8192, (4, 64), generator=g)
    size = base.numel() * base.element_size()
    peaks = []
    for logps, entropy in ((whole_logps, whole_entropy), (lambda x, t: chunked_token_logps(x, t, TEMPERATURE, 32),
                                                          lambda x: chunked_token_entropy(x, TEMPERATURE, 32))):
        logits = base.clone().requires_grad_(True)
        with LiveBytes() as live:
            values = logps(logits, targets)
            entropy(logits)
            values.sum().backward()
        peaks.append(live.snapshot().peak)
    whole, chunked = peaks
    assert whole >= 4 * size and chunked < 1.5 * size, (whole / size, chunked / size)
    assert token_entropy(base[:1, :2], TEMPERATURE).shape == (1, 2)
