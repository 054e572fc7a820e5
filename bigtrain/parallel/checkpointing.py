"""Activation checkpointing applied to a plain module from outside the model; `apply_checkpointing` is the job's
entry point (`bigtrain.train.assemble`).

Two ways: the family's own switch (HF gradient checkpointing), or DeepSpeed's
`deepspeed.checkpointing.checkpoint` around each repeated block, which honours the
`activation_checkpointing` section of a DeepSpeed config (partitioned / CPU activations).
With ALST's offload of the hidden states (`activation_checkpointing.offload_hidden_states`), transformers' own
checkpointing inside DeepSpeed's offloading context manager keeps each checkpointed block's input in host memory.
Pipelines use `activation_checkpoint_interval` instead (see `to_pipeline_module`).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import deepspeed
import torch
from deepspeed import comm as dist
from torch import nn

from bigtrain.models.spec import ModelSpec

METHODS = ("auto", "native", "deepspeed")


@contextlib.contextmanager
def _buffers_kept(block: nn.Module) -> Iterator[None]:
    """Run the recompute on copies of the buffers, so BatchNorm's running stats move once a step.

    The copies are swapped in rather than restored in place: autograd saved them for the
    backward pass, and an in-place restore would invalidate that.
    """
    originals = [(m, name, buf) for m in block.modules() for name, buf in m._buffers.items() if buf is not None]
    for m, name, buf in originals:
        m._buffers[name] = buf.clone()
    try:
        yield
    finally:
        for m, name, buf in originals:
            m._buffers[name] = buf


def _checkpointed(block: nn.Module) -> Callable[..., Any]:
    """`block.forward`, recomputed in the backward pass instead of storing its activations."""
    forward = block.forward

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        calls = [0]

        def once(*a: Any, **kw: Any) -> Any:
            calls[0] += 1
            if calls[0] == 1:
                return forward(*a, **kw)
            with _buffers_kept(block):
                return forward(*a, **kw)

        tensors = [a for a in (*args, *kwargs.values()) if torch.is_tensor(a)]
        if any(t.requires_grad for t in tensors):
            return deepspeed.checkpointing.checkpoint(once, *args, **kwargs)
        # The reentrant checkpoint would cut the parameters' gradients when no input needs
        # one (e.g. a frozen embedding below); the non-reentrant one keeps them.
        return deepspeed.checkpointing.non_reentrant_checkpoint(functools.partial(once, **kwargs), *args)

    run.bigtrain_checkpointed = True  # type: ignore[attr-defined]
    return run


def _wrap_blocks(spec: ModelSpec, module: nn.Module, every_n: int) -> int:
    if spec.checkpoint_blocks is None:
        raise ValueError(f"{spec.family} names no blocks to checkpoint (spec.checkpoint_blocks is None)")
    count = 0
    for i, (parent, attr) in enumerate(spec.checkpoint_blocks(module)):
        block = getattr(parent, attr)
        if i % every_n or getattr(block.forward, "bigtrain_checkpointed", False):
            continue
        # Patch the instance's forward rather than wrapping the block in a new module, so
        # the state dict keeps its names and module hooks (ZeRO-3 fetches) still run.
        block.forward = _checkpointed(block)
        count += 1
    return count


def apply_activation_checkpointing(spec: ModelSpec, module: nn.Module, every_n: int = 1, method: str = "auto",
                                   ds_config: dict | None = None) -> int:
    """Recompute block activations in the backward pass; return how many blocks are checkpointed.

    Blocks 0, every_n, 2*every_n, ... are checkpointed. method "auto" uses the family's
    native switch when it has one (and no ds_config is given), else DeepSpeed's checkpoint.
    `ds_config` (the run's resolved DeepSpeed config) configures `deepspeed.checkpointing`
    from its `activation_checkpointing` section (partitioned / CPU activations); without it
    DeepSpeed's defaults apply. Needs the process group when ds_config is given.
    """
    if method not in METHODS:
        raise ValueError(f"activation checkpointing method={method!r}: use one of {', '.join(METHODS)}")
    if every_n < 1:
        raise ValueError(f"activation checkpointing every_n={every_n}: must be >= 1")
    native = spec.enable_native_checkpointing
    if method == "native" and native is None:
        raise ValueError(f"{spec.family} has no native activation checkpointing; use method='deepspeed'")
    if method == "native" or (method == "auto" and native is not None and ds_config is None):
        native(module, every_n=every_n)
        return len(range(0, len(spec.checkpoint_blocks(module)), every_n)) if spec.checkpoint_blocks else 0
    if ds_config is not None:
        assert dist.is_initialized(), "deepspeed.checkpointing.configure needs the process group"
        deepspeed.checkpointing.configure(None, deepspeed_config=ds_config)
    return _wrap_blocks(spec, module, every_n)


def apply_checkpointing(spec: Any, model: nn.Module, every_n: int, ds_config: dict, offload: bool | str,
                        sequence: int = 1) -> int:
    """Activation checkpointing for the engine, with ALST's offload of the checkpointed hidden states when
    `activation_checkpointing.offload_hidden_states` resolves on: transformers' own (non-reentrant) checkpointing,
    inside DeepSpeed's `CheckpointHiddenStatesOffload` around every forward (it marks each checkpointed layer's
    input and keeps it in host memory until backward); else DeepSpeed's checkpoint (`apply_activation_checkpointing`).
    Returns how many blocks are checkpointed."""
    from deepspeed.accelerator import get_accelerator

    from bigtrain.config.rules import offload_hidden_states_wanted
    device = get_accelerator().device_name()
    tokens = spec.seq_len // sequence if spec.seq_len else None
    if not offload_hidden_states_wanted(offload, device, True, tokens, spec.hidden_size):
        return apply_activation_checkpointing(spec, model, every_n=every_n, ds_config=ds_config)
    if spec.enable_native_checkpointing is None or not _checkpointing_layers(model):
        if offload is True:
            raise ValueError(f"activation_checkpointing.offload_hidden_states=true: {spec.family} has no transformers "
                             "checkpointing layers to offload the inputs of; set it to auto or false")
        return apply_activation_checkpointing(spec, model, every_n=every_n, ds_config=ds_config)
    blocks = apply_activation_checkpointing(spec, model, every_n=every_n, method="native")
    install_hidden_state_offload(model, pinned=device != "cpu")
    return blocks


def _checkpointing_layers(model: nn.Module) -> bool:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return False
    return any(isinstance(m, GradientCheckpointingLayer) for m in model.modules())


def install_hidden_state_offload(model: nn.Module, pinned: bool = True) -> Any:
    """Run `model`'s training forwards inside DeepSpeed's offloading context manager (its saved-tensor hooks pack
    during the forward; backward unpacks through them). Returns the manager (its `stats` count what it moved)."""
    from deepspeed.runtime.activation_checkpointing.offload_activations import (
        get_checkpoint_hidden_states_offloading_ctx_manager)
    manager = get_checkpoint_hidden_states_offloading_ctx_manager(use_pin_memory=pinned, use_streams=pinned)
    plain = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not (model.training and torch.is_grad_enabled()):
            return plain(*args, **kwargs)
        with manager:
            return plain(*args, **kwargs)

    model.forward = forward
    return manager
