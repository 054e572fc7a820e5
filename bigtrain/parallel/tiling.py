"""ALST's memory tiling beside Ulysses, applied to a plain module from outside: DeepSpeed's `TiledMLP` computes each
position-wise MLP over tiles of the sequence and recomputes each tile's forward in the backward pass, so a layer
keeps only its input for backward instead of the MLP's intermediate activations (gate, up, their product: several
times the hidden width per token). Every token's MLP is independent of the others, so the result is the plain
computation's, tile by tile.

The MLPs are found by what they are, not by family: the modules transformers (and bigtrain's families built on it)
name `...MLP` (LlamaMLP, Qwen2MLP, MistralMLP, GPT2MLP, ...), whose forward takes the hidden states alone; mixtures of
experts (`...SparseMoeBlock`) are not MLPs here. A tile is `hidden_size` tokens, ALST's choice. Every rank of a run
computes the same number of tiles, which ZeRO-3's per-tile parameter gathers need: rows of data.seq_len tokens (a
sequence-parallel rank's slice the same length on every rank) have as many anyway; rows whose length differs from
rank to rank (an online objective's completions, several turns of them on one rank and one on another) have the
ranks agree on the most any needs (one all-reduce per MLP call, where the weights are partitioned), a rank with
fewer padding its input to as many whole tiles (the padding's outputs dropped: it adds nothing to a gradient).

With the MLP tiled, the RMSNorms go lean too (parallel/rms_norm.py: ALST's fused RMSNorm, done as a function that
keeps only its input and makes no sequence-long fp32 temporary), over the same tiles.
"""
from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from bigtrain.config.rules import tiled_mlp_wanted
from bigtrain.parallel.rms_norm import apply_lean_rms_norm


def mlp_modules(model: nn.Module) -> list[nn.Module]:
    """The position-wise MLP blocks of `model` (outermost only)."""
    found: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if type(module).__name__.endswith("MLP") and any(True for _ in module.parameters()):
            found.append(module)
            inside.update(id(m) for m in module.modules())
    return found


def apply_tiled_mlp(model: nn.Module, tile: int) -> int:
    """Compute every MLP of `model` with DeepSpeed's TiledMLP over tiles of `tile` tokens while training; returns
    how many MLPs were tiled. Outside training (eval, no grad) the MLP runs as it was."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
    if tile < 1:
        raise ValueError(f"tiled MLP: tile={tile} tokens, must be >= 1")
    modules = mlp_modules(model)
    for module in modules:
        if getattr(module, "_bigtrain_tiled", False):
            continue
        plain = module.forward
        params = [p for p in module.parameters()]

        def tiled(x: torch.Tensor, *args: Any, _plain: Any = plain, _module: nn.Module = module,
                  _params: list = params, **kwargs: Any) -> torch.Tensor:
            if args or kwargs or not (_module.training and torch.is_grad_enabled()) or x.dim() < 2:
                return _plain(x, *args, **kwargs)
            length = x.shape[-2]
            shards = max(1, math.ceil(length / tile))
            if _partitioned(_params):  # as many tiles on every rank, each gathering the weights
                shards = _most(shards, x.device)
                x = nn.functional.pad(x, (0, 0, 0, shards * tile - length))  # exactly `shards` chunks of `tile`
            out = TiledMLP.apply(lambda _self, part: _plain(part.contiguous()), _module, x, shards, _params)
            return out[..., :length, :]

        module.forward = tiled
        module._bigtrain_tiled = True
    return len(modules)


def _partitioned(params: list) -> bool:
    """Whether these are ZeRO-3's partitioned weights in a process group (each tile's forward gathers them)."""
    return torch.distributed.is_initialized() and any(hasattr(p, "ds_id") for p in params)


def _most(count: int, device: Any) -> int:
    value = torch.tensor([count], dtype=torch.long, device=device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return int(value.item())


def apply_tiles(model: nn.Module, tile: int) -> tuple[int, int]:
    """ALST's levers on one rank over tiles of `tile` tokens: every MLP tiled, and where there are MLPs, every
    Llama-style RMSNorm lean; returns (MLPs, RMSNorms). The engine (`apply_tiling`) and the estimate's count
    (bigtrain.estimate.counting) apply them alike."""
    count = apply_tiled_mlp(model, tile)
    return count, apply_lean_rms_norm(model, tile) if count else 0


def apply_tiling(model: nn.Module, spec: Any, setting: bool | str, sequence: int = 1) -> int:
    """`activation_checkpointing.tiled_mlp` for this job: the MLPs tiled (0 when off or when the model has none), and
    the Llama-style RMSNorms made lean over the same tiles."""
    hidden = spec.hidden_size
    tokens = spec.seq_len // sequence if spec.seq_len else None
    if not tiled_mlp_wanted(setting, tokens, hidden) or not hidden:
        return 0
    count, norms = apply_tiles(model, hidden)
    if count and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
        logging.getLogger("bigtrain").info("tiled MLP (activation_checkpointing.tiled_mlp=%s): %d MLPs over tiles of "
                                           "%d tokens (DeepSpeed's TiledMLP), %d RMSNorms lean", setting, count,
                                           hidden, norms)
    if count == 0 and setting is True:
        raise ValueError(f"activation_checkpointing.tiled_mlp=true: {spec.family} has no MLP blocks to tile (modules "
                         "named ...MLP); set it to auto or false")
    return count
