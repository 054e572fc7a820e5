"""A memory-lean RMSNorm for ALST's long sequences, applied from outside beside the tiled MLP (parallel/tiling.py).

transformers' Llama-family RMSNorm (`weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`) keeps for backward its input
cast to fp32, the normalized x and their product's operands, and its autograd backward makes four or five
full-size fp32 temporaries (pow, div, add, mul): at a long sequence, with the MLP tiled and the blocks
checkpointed, the largest thing left at a rank's peak (docs/parallelism.md, "Every byte per token"). ALST uses
Liger's fused RMSNorm, which keeps only its input and the per-token rstd. `LeanRMSNorm` does the same without a
kernel of its own: it saves its input (in the input's dtype, the tensor the block already holds) and the weight,
and its backward recomputes the normalization tile by tile (`hidden_size` tokens, the tiled MLP's tile) with
Liger's formula, dx = rstd * (g - x^ * mean(g * x^)), g = dy * w, so the only full-size tensor it makes is the
input's gradient. The result is the plain module's: the same forward, its gradients within float rounding.

The modules are matched by what they compute, not by family: a module with a 1-D `weight` and a
`variance_epsilon` whose own forward gives the lean forward's output on a probe (Gemma's `1 + weight`, T5's
cast-before-multiply or anything else is left as it is). Only this model's instances change (never the class), so
a reference or teacher model in the same process runs as built.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

_PROBE_TOKENS = 7  # an odd count, a few rows


def _normalized(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x^ = x * rstd in fp32, rstd), the plain module's arithmetic."""
    x32 = x.to(torch.float32)
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return x32 * rstd, rstd


class LeanRMSNorm(torch.autograd.Function):
    """y = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), keeping only x and weight for backward, computed over
    tiles of `tile` tokens (forward and backward) so that no fp32 temporary spans the sequence."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, tile: int) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.tile = eps, tile
        rows = x.reshape(-1, x.shape[-1])
        out = torch.empty(rows.shape, dtype=torch.result_type(weight, x), device=x.device)
        for start in range(0, rows.shape[0], tile):
            part = rows[start:start + tile]
            out[start:start + tile] = weight * _normalized(part, eps)[0].to(x.dtype)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        rows, dys = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        dx = torch.empty_like(rows) if want_x else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        for start in range(0, rows.shape[0], ctx.tile):
            part, dy = rows[start:start + ctx.tile], dys[start:start + ctx.tile]
            x_hat, rstd = _normalized(part, ctx.eps)
            if want_w:  # d(weight * h) / d weight, h = x^ in the input's dtype, as the plain module multiplies
                dw += (dy * x_hat.to(x.dtype)).sum(0, dtype=torch.float32)
            if want_x:  # the gradient reaching h is cast to h's dtype, then to fp32 (the plain module's casts)
                g = (dy * weight).to(x.dtype).to(torch.float32)
                dx[start:start + ctx.tile] = (rstd * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))).to(x.dtype)
        return (dx.view(x.shape) if want_x else None, dw.to(weight.dtype) if want_w else None, None, None)


def lean_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, tile: int) -> torch.Tensor:
    return LeanRMSNorm.apply(x, weight, eps, tile)


def is_lean_compatible(module: nn.Module) -> bool:
    """Whether `module` is a Llama-style RMSNorm: a 1-D `weight`, a float `variance_epsilon`, and its own forward
    (run on a copy with a stand-in weight, so a ZeRO-3 partitioned one is not needed) equals the lean forward."""
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if not isinstance(weight, torch.Tensor) or not isinstance(eps, (float, int)) or isinstance(eps, bool):
        return False
    shape = tuple(getattr(weight, "ds_shape", weight.shape))
    if len(shape) != 1 or shape[0] < 1 or len(list(module.children())) or len(module._parameters) != 1:
        return False
    generator = torch.Generator().manual_seed(0)
    stand_in = nn.Parameter(torch.rand(shape, generator=generator) + 0.5)
    twin = copy.copy(module)  # the instance's attributes, its own parameter dict: the module is left as it is
    twin._parameters = {"weight": stand_in}
    # fp32, and bf16 hidden states with an fp32 weight: where the casts differ (T5's norm does not round x^)
    for dtype in (torch.float32, torch.bfloat16):
        probe = (torch.randn(2, _PROBE_TOKENS, shape[0], generator=generator) * 3).to(dtype)
        try:
            with torch.no_grad():
                plain = type(module).forward(twin, probe)
        except Exception:  # a forward that wants more than the hidden states is not this norm
            return False
        with torch.no_grad():
            lean = lean_rms_norm(probe, stand_in, float(eps), 3)
        if not (isinstance(plain, torch.Tensor) and plain.shape == lean.shape and plain.dtype == lean.dtype
                and torch.allclose(plain, lean, rtol=1e-6, atol=1e-6)):
            return False
    return True


def _twin_key(module: nn.Module) -> tuple | None:
    """What `is_lean_compatible`'s verdict depends on: the class (its forward), the weight's shape and the
    instance's plain attributes (eps, flags); None where an attribute is anything else (it is probed on its own)."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return None
    attributes = []
    for name, value in vars(module).items():
        if isinstance(value, (bool, int, float, str, type(None))):
            attributes.append((name, value))
        elif not name.startswith("_"):
            return None
    return type(module), tuple(getattr(weight, "ds_shape", weight.shape)), tuple(sorted(attributes))


def apply_lean_rms_norm(model: nn.Module, tile: int) -> int:
    """Compute every Llama-style RMSNorm of `model` with `LeanRMSNorm` over tiles of `tile` tokens while training;
    returns how many. Outside training (eval, no grad) a norm runs its own forward."""
    if tile < 1:
        raise ValueError(f"lean RMSNorm: tile={tile} tokens, must be >= 1")
    count = 0
    # A model's norms are a few classes and shapes: probed once each (two probes a norm cost a 128K-context memory
    # estimate, 9 models of 65 norms, ~60 of its ~100 CPU seconds)
    verdicts: dict[tuple, bool] = {}
    for module in model.modules():
        if getattr(module, "_bigtrain_lean_norm", False):
            count += 1
            continue
        key = _twin_key(module)
        if key is None:
            compatible = is_lean_compatible(module)
        elif key not in verdicts:
            compatible = verdicts[key] = is_lean_compatible(module)
        else:
            compatible = verdicts[key]
        if not compatible:
            continue
        plain = module.forward

        def lean(x: torch.Tensor, *args: Any, _plain: Any = plain, _module: nn.Module = module,
                 **kwargs: Any) -> torch.Tensor:
            if args or kwargs or not (_module.training and torch.is_grad_enabled()):
                return _plain(x, *args, **kwargs)
            return lean_rms_norm(x, _module.weight, float(_module.variance_epsilon), tile)

        module.forward = lean
        module._bigtrain_lean_norm = True
        count += 1
    return count
