"""Vision-language models (`--model vlm --set model.pretrained=DIR`): any Hugging Face directory whose config
transformers maps to `AutoModelForImageTextToText` (LLaVA, Idefics3 / SmolVLM, Gemma 3, PaliGemma, Mllama, ...),
loaded with the processor saved beside it (`bigtrain.data.vision`).

The model is the family's own class (`LlavaForConditionalGeneration`, ...): a vision tower, a projector and a
language model. The tower and the projector can each be held frozen (`freeze_vision`, default true, as LLaMA-Factory
and ms-swift do: the tower was trained on far more images than a fine-tuning set holds; `freeze_projector`, default
false); under ZeRO-3 all three are partitioned alike, frozen or not. A batch is the tokens (image placeholders
expanded to the family's image tokens by the processor) with the processor's pixel tensors beside them
(`bigtrain.models.pixels`); the loss is the next-token loss on the answers. LoRA adapters go on the language
model's linear layers (and the tower's with lora.vision_tower: `lora_targets`).

Splits: ZeRO 0-3 only. A pipeline cuts a list of decoder blocks, and AutoTP / Ulysses split the language model's
attention while the tower's and the image tokens' layout is the family's own: none is built for these models.

FLOPs per token: the language model's (6N + attention, `hf_common`); the tower's are left out (it sees the image's
patches, not the sequence's tokens), so MFU reads low by the tower's share.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bigtrain.models import hf_common, hf_dir
from bigtrain.models.family import DataFacts, Family
from bigtrain.models.losses import causal_lm_loss
from bigtrain.models.spec import LayerDef, ModelSpec

PARTS = ("vision", "projector", "language")  # a vision-language model's parts, as freezing and LoRA name them


@dataclass(frozen=True)
class VLMSettings:
    """Every field is a `build("vlm", "custom", ...)` override key (model.overrides.NAME)."""

    pretrained: str | None = None  # the local directory (config.json, weights, the processor's files)
    seq_len: int | None = None  # tokens per sample, image tokens included; default min(max positions, 2048)
    vocab_size: int | None = None  # the data's tokenizer length: checked to fit the embedding
    dropout: float | None = None  # the language model's dropout rates; None keeps the directory's
    attn_implementation: str | None = None  # None: sdpa where the class supports it, else its default (eager)
    trust_remote_code: bool = False  # run model code shipped in the directory (auto_map)
    freeze_vision: bool = True  # the vision tower's weights are not trained
    freeze_projector: bool = False  # the projector's (the layers between the tower and the language model)

    def __post_init__(self) -> None:
        if not self.pretrained:
            raise ValueError("--model vlm needs a local Hugging Face directory of a vision-language model: "
                             "--set model.pretrained=DIR")
        for key in ("seq_len", "vocab_size"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"vlm {key}={value!r}: must be a positive integer")
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"vlm dropout={self.dropout}: must be in [0, 1)")


def read_vlm_config(path: str, trust_remote_code: bool = False) -> Any:
    """The directory's config; ValueError (one line) when it is not a vision-language model."""
    config = hf_dir.read_config(path, trust_remote_code=trust_remote_code)
    if not hf_dir.is_vision_language(config):
        raise ValueError(f"{path} holds a {config.model_type!r} model, which reads no images "
                         "(transformers has no AutoModelForImageTextToText class for it): train it with --model hf")
    return config


def model_class(config: Any) -> type:
    """The class `AutoModelForImageTextToText` builds for this config."""
    from transformers import AutoModelForImageTextToText
    from transformers.models.auto.auto_factory import _get_model_class
    return _get_model_class(config, AutoModelForImageTextToText._model_mapping)


def part_names(model: nn.Module) -> dict[str, list[str]]:
    """{part: the names of its modules in `model`}: the vision tower (transformers' `get_encoder("image")`), the
    language model (`get_decoder()`), and the projector: the other children of the base model that hold weights (a
    LLaVA's multi_modal_projector, an Idefics3's connector). The output head belongs to none."""
    base = getattr(model, model.base_model_prefix, model)
    tower, decoder = model.get_encoder(modality="image"), model.get_decoder()
    names = {id(module): name for name, module in model.named_modules()}
    if tower is model or id(tower) not in names or id(decoder) not in names:
        raise ValueError(f"{type(model).__name__}: its vision tower or language model is not found under the names "
                         "transformers gives them (get_encoder('image'), get_decoder()); this architecture is not "
                         "supported by --model vlm")
    projector = [names[id(child)] for child in base.children()
                 if child is not tower and child is not decoder and any(True for _ in child.parameters())]
    return {"vision": [names[id(tower)]], "projector": projector, "language": [names[id(decoder)]]}


def in_parts(name: str, prefixes: list[str]) -> bool:
    return any(name == p or name.startswith(f"{p}.") for p in prefixes)


def freeze(model: nn.Module, parts: tuple[str, ...]) -> nn.Module:
    """The weights of `parts` (of PARTS) no longer trained: the engine gives the optimizer only what still is."""
    found = part_names(model)
    prefixes = [name for part in parts for name in found[part]]
    for name, param in model.named_parameters():
        if in_parts(name, prefixes):
            param.requires_grad_(False)
    return model


def lora_targets(model: nn.Module, targets: str | list[str], vision_tower: bool) -> list[str]:
    """The full names of the linear layers LoRA adapts: those of the language model (and the vision tower's with
    `vision_tower`) that `targets` names (all-linear: every one; else the layers whose last name is listed)."""
    found = part_names(model)
    prefixes = found["language"] + (found["vision"] if vision_tower else [])
    chosen = [name for name, module in model.named_modules()
              if isinstance(module, nn.Linear) and in_parts(name, prefixes)
              and (targets == "all-linear" or name.rsplit(".", 1)[-1] in targets)]
    if not chosen:
        where = "language model" + (" or vision tower" if vision_tower else "")
        raise ValueError(f"lora.targets={targets}: no linear layer of the {where} has that name")
    return chosen


def vision_batch(batch: dict) -> tuple[dict, torch.Tensor]:
    """{"input_ids", "labels", "attention_mask", "pixels": PixelInputs} -> (the model's keyword inputs, labels): the
    tokens with the processor's pixel tensors (and image-token marks) beside them (none for a text-only batch)."""
    if "input_ids" not in batch or "labels" not in batch:
        raise ValueError(f"vlm batches need keys 'input_ids' and 'labels'; got {sorted(batch)}")
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask") if key in batch}
    pixels = batch.get("pixels")
    if pixels is not None:
        inputs.update(pixels.inputs_for(batch["input_ids"]))
    return inputs, batch["labels"]


def _configure(s: VLMSettings, config: Any, cls: type) -> Any:
    """No KV cache (in the language model's config too), the attention kernel, the language model's dropout."""
    text = config.get_text_config()
    hf_common.set_dropout(text, s.dropout)
    hf_common.set_training_defaults(config, hf_common.choose_attention(cls, s.attn_implementation)[0])
    text.use_cache = False
    return config


def _no_pipeline() -> list[LayerDef]:
    raise ValueError("pipeline.stages > 1 with --model vlm: a vision-language model is not cut into pipeline stages; "
                     "set pipeline.stages=1 (ZeRO-3 partitions it instead)")


def frozen_parts(s: VLMSettings) -> tuple[str, ...]:
    return tuple(part for part, on in (("vision", s.freeze_vision), ("projector", s.freeze_projector)) if on)


def _construct(s: VLMSettings, cls: type, config: Any, weights: bool, drop: tuple[str, ...]) -> nn.Module:
    model = (hf_dir.load_pretrained(cls, s.pretrained, config, drop, **({"trust_remote_code": True}
                                                                      if s.trust_remote_code else {}))
             if weights else hf_common.construct_hf(cls, config))
    return freeze(model, frozen_parts(s)) if frozen_parts(s) else model


def make_spec(size: str, fields: dict[str, Any]) -> ModelSpec:
    """Spec of the directory's vision-language model (see `VLMSettings`)."""
    s = VLMSettings(**fields)
    config = read_vlm_config(s.pretrained, s.trust_remote_code)
    cls = model_class(config)
    config = _configure(s, config, cls)
    text = config.get_text_config()
    positions = getattr(text, "max_position_embeddings", None) or 2048
    seq_len = s.seq_len or min(positions, 2048)
    if s.vocab_size is not None and s.vocab_size > text.vocab_size:
        raise ValueError(f"the tokenizer has {s.vocab_size} tokens but {s.pretrained}'s model has {text.vocab_size} "
                         "embedding rows; train with the directory's own processor (leave data.tokenizer unset)")
    if seq_len > positions:
        raise ValueError(f"data.seq_len={seq_len} exceeds {s.pretrained}'s max_position_embeddings={positions}: "
                         f"use --set data.seq_len={positions} or less")
    meta = hf_common.meta_module(cls, config)
    found = part_names(meta)
    language = meta.get_submodule(found["language"][0])
    n_all = sum(p.numel() for p in meta.parameters())
    n_lm = hf_common.matmul_params(language) + sum(p.numel() for p in meta.get_output_embeddings().parameters())
    per_token = hf_common.flops_per_token(n_lm, text.num_hidden_layers, hf_common.attention_width(text), seq_len)
    drop = hf_dir.resized_tensors(s.pretrained, {k: tuple(v.shape) for k, v in meta.state_dict().items()})
    weights = hf_dir.has_weights(s.pretrained)
    from bigtrain.models.pixels import fixed_vision_inputs
    return ModelSpec(
        family="vlm", size=size, config=config, construct=lambda: _construct(s, cls, config, weights, drop),
        init_module=hf_common.hf_init_fn(cls, config), layers=_no_pipeline,
        loss=hf_common.causal_module_loss, pipeline_loss=causal_lm_loss, batch_to_inputs=vision_batch,
        num_params=n_all, flops_per_sample=seq_len * per_token, tokens_per_sample=seq_len, modality="vision",
        checkpoint_blocks=hf_common.decoder_blocks, enable_native_checkpointing=hf_common.native_checkpointing,
        pretrained=s.pretrained if weights else None, hf_class=cls, seq_len=seq_len, vocab_size=text.vocab_size,
        source_dir=s.pretrained, weights_note=hf_dir.weights_note(s.pretrained), frozen_parts=frozen_parts(s),
        fixed_inputs=lambda: fixed_vision_inputs(s.pretrained))


def modality(fields: dict[str, Any]) -> str:
    """'vision', once the directory is checked to hold a vision-language model."""
    s = VLMSettings(**{k: v for k, v in fields.items() if k in VLMSettings.__dataclass_fields__})
    read_vlm_config(s.pretrained, s.trust_remote_code)
    return "vision"


def data_overrides(family: Family, size: str, facts: DataFacts, pretrained: str | None) -> dict[str, Any]:
    """The directory's shape, the data's length and the tokenizer's vocabulary (checked to fit)."""
    return {"pretrained": pretrained, "seq_len": facts.seq_len, "vocab_size": facts.vocab_size or None}


FAMILY = Family(name="vlm", settings_cls=VLMSettings, sizes={}, make=make_spec, modality=modality,
                derive=data_overrides, parallel=frozenset({"zero"}))
