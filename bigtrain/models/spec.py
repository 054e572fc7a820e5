"""The contract between a model family and the rest of bigtrain.

A builder returns a ModelSpec. Nothing here knows about DeepSpeed: the pipeline
layer list is plain data (classes + args) that `bigtrain.parallel` turns into
`LayerSpec` / `TiedLayerSpec`, and activation checkpointing is applied from outside.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal

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


def call_module(module: nn.Module, inputs: Any) -> Any:
    """Run a plain module on `batch_to_inputs`' inputs: a dict goes in as keyword arguments
    (input_ids, attention_mask), anything else as the one positional argument."""
    return module(**inputs) if isinstance(inputs, dict) else module(inputs)


def pipeline_inputs(inputs: Any) -> Any:
    """The same inputs for the first pipeline layer, which takes one tensor or a tuple of them."""
    if isinstance(inputs, dict):
        values = tuple(inputs.values())
        return values[0] if len(values) == 1 else values
    return inputs


def output_logits(output: Any) -> torch.Tensor:
    """The logits of a module's output: HF models return an output object, ours a tensor."""
    return output.logits if hasattr(output, "logits") else output


Modality = Literal["text", "classify", "image", "vision"]  # which data the runner feeds a model (vision: images + text)
EvalMetric = Literal["perplexity", "accuracy"]  # language models, classifiers


@dataclass
class ModelSpec:
    """Everything the engine and trainer need to know about a model, and nothing more."""

    family: str  # "gpt2" | "llama" | "hf" | "vlm" | "encoder" | "resnet"
    size: str
    config: Any  # the family's own config (GPT2Config, LlamaConfig, ResNetConfig, ...)
    construct: Callable[[], nn.Module]
    """The plain module, fp32, with its weights not initialised yet, or loaded from `pretrained`."""
    init_module: Callable[[nn.Module], None] | None
    """The family's init rule for one module (its own and its direct children's parameters), e.g. HF's
    `_init_weights`; `bigtrain.models.init.init_seeded` applies it seeded by each module's plain name."""
    layers: Callable[[], list[LayerDef]]  # pipeline form; sequential run == plain module
    loss: Callable[[Any, torch.Tensor], torch.Tensor]  # (module output, labels) -> scalar
    pipeline_loss: Callable[[Any, torch.Tensor], torch.Tensor]  # (last layer output, labels)
    batch_to_inputs: Callable[[dict], tuple[Any, torch.Tensor]]  # batch -> (inputs, labels)
    num_params: int
    flops_per_sample: float  # training FLOPs (fwd + bwd) for one sample
    tokens_per_sample: int = 0  # > 0 for token models; tokens/s = samples/s * this
    modality: Modality = "text"
    checkpoint_blocks: Callable[[nn.Module], list[tuple[nn.Module, str]]] | None = None
    """(parent, attribute) of each repeated block in the plain module, for activation checkpointing."""
    enable_native_checkpointing: Callable[..., None] | None = None
    """Family's own activation checkpointing switch (HF gradient checkpointing), preferred when set.
    Called as fn(module, every_n=1): checkpoint blocks 0, every_n, 2*every_n, ..."""
    pretrained: str | None = None
    """Directory whose weights `construct` loads; the pipeline form reads its layers from there too."""
    eval_metric: EvalMetric = "perplexity"
    hf_class: type | None = None  # the transformers class of the plain module: export writes an HF directory
    seq_len: int | None = None  # token models: tokens per sample
    vocab_size: int | None = None  # token models: rows of the embedding and output layer
    num_classes: int | None = None  # classifiers
    image_size: int | None = None  # image models: the side of a square input
    source_dir: str | None = None  # the pretrained directory the shape came from (with weights or not)
    weights_note: str | None = None  # what a directory without weights means for the initial weights
    frozen_parts: tuple[str, ...] = ()  # parts whose weights do not train (a vlm's "vision" tower, "projector")
    fixed_inputs: Callable[[], Any] | None = None
    """The same inputs every time, where tokens alone do not exercise the model (a vision-language model's prompts
    with images): what an export's logits are checked on."""

    def build(self, seed: int | None = None) -> nn.Module:
        """The plain module, fp32, initialised from `seed` (None: a seed drawn from torch's global RNG),
        or holding the pretrained weights. The same seed gives the same weights in every build path."""
        from bigtrain.models.init import seed_from_global_rng, untouched_global_rng

        seed = seed_from_global_rng() if seed is None else seed
        with untouched_global_rng():
            module = self.construct()
        self.initialize(module, seed)
        return module

    @property
    def hidden_size(self) -> int:
        """The model's hidden width (transformers' `hidden_size`, GPT-2's `n_embd` through its alias; a
        multimodal config's text model's); 0 for a model without one (an image classifier)."""
        config = getattr(self.config, "get_text_config", lambda: self.config)()
        width = getattr(config, "hidden_size", 0)
        return width if isinstance(width, int) else 0

    def initialize(self, module: nn.Module, seed: int, gather: Any = None, writer: bool = True) -> int:
        """Seeded init of a constructed plain module (see `bigtrain.models.init`); with pretrained weights
        only the modules the checkpoint lacked (`module.bigtrain_uninitialized`, e.g. a new classifier head).
        `gather`/`writer`: see `init_seeded` (ZeRO-3). Returns the number of modules initialised."""
        from bigtrain.models.init import init_seeded

        if self.init_module is None:
            return 0
        only = getattr(module, "bigtrain_uninitialized", None) if self.pretrained else None
        if self.pretrained and not only:
            return 0
        return init_seeded(module, self.init_module, seed, gather=gather, writer=writer, only=only)


def classification_batch(family: str) -> Callable[[dict], tuple[dict, torch.Tensor]]:
    """A classifier's `batch_to_inputs`: {"input_ids": [B,T], "labels": [B][, "attention_mask": [B,T]]} ->
    ({input_ids[, attention_mask]}, labels)."""
    def to_inputs(batch: dict) -> tuple[dict, torch.Tensor]:
        if "input_ids" not in batch or "labels" not in batch:
            raise ValueError(f"{family} batches need keys 'input_ids' and 'labels'; got {sorted(batch)}")
        inputs = {"input_ids": batch["input_ids"]}
        if "attention_mask" in batch:
            inputs["attention_mask"] = batch["attention_mask"]
        return inputs, batch["labels"]

    return to_inputs
