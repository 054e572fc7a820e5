"""The contract between a model family and the rest of bigtrain.

A builder returns a ModelSpec. Nothing here knows about DeepSpeed: the pipeline
layer list is plain data (classes + args) that `bigtrain.parallel` turns into
`LayerSpec` / `TiedLayerSpec`, and activation checkpointing is applied from outside.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn


@dataclass(frozen=True)
class LayerDef:
    """One pipeline layer: `cls(*args, **kwargs)` built lazily on the stage that owns it.

    `param_map` maps a parameter-name prefix inside this layer to the prefix of the same
    tensor in the plain module (e.g. {"block.": "transformer.h.3."}); export and the
    equivalence tests use it to move weights between the two forms.

    `tie_key` makes the layer share its `tied_weight_attr` parameters with every other
    layer of the same key (input embedding / output head); `tie_forward(module, x)` is
    then the forward used for this occurrence.
    """

    cls: type[nn.Module]
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    param_map: dict[str, str] = field(default_factory=dict)
    tie_key: str | None = None
    tie_forward: Callable[[nn.Module, Any], Any] | None = None
    tied_weight_attr: tuple[str, ...] = ("weight",)
    checkpointable: bool = False  # a repeated block worth recomputing under activation checkpointing


@dataclass
class ModelSpec:
    """Everything the engine and trainer need to know about a model, and nothing more."""

    family: str  # "gpt2" | "resnet" | "encoder"
    size: str
    config: Any  # the family's own config (GPT2Config, ResNetConfig, ...)
    build: Callable[[], nn.Module]  # the plain module, fp32, random init (or local pretrained)
    layers: Callable[[], list[LayerDef]]  # pipeline form; sequential run == plain module
    loss: Callable[[Any, torch.Tensor], torch.Tensor]  # (module output, labels) -> scalar
    pipeline_loss: Callable[[Any, torch.Tensor], torch.Tensor]  # (last layer output, labels)
    batch_to_inputs: Callable[[dict], tuple[Any, torch.Tensor]]  # batch -> (inputs, labels)
    num_params: int
    flops_per_sample: float  # training FLOPs (fwd + bwd) for one sample
    tokens_per_sample: int = 0  # > 0 for token models; tokens/s = samples/s * this
    modality: str = "text"  # "text" | "image": which data the runner feeds it
    checkpoint_blocks: Callable[[nn.Module], list[tuple[nn.Module, str]]] | None = None
    """(parent, attribute) of each repeated block in the plain module, for activation checkpointing."""
    enable_native_checkpointing: Callable[..., None] | None = None
    """Family's own activation checkpointing switch (HF gradient checkpointing), preferred when set.
    Called as fn(module, every_n=1): checkpoint blocks 0, every_n, 2*every_n, ..."""
    extra: dict = field(default_factory=dict)
