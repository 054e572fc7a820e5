"""Any local Hugging Face directory (`--model hf --set model.pretrained=DIR`): `AutoConfig` decides.

Causal LMs go through `AutoModelForCausalLM`, sequence classifiers through
`AutoModelForSequenceClassification` (see `hf_dir.task_of`). The shape is the directory's (no
size to choose); a directory with only a config starts from random weights (one line says
so). Under ZeRO-3 the weights load partitioned (`bigtrain.parallel.zero_init`). Llama-style
decoders (llama, mistral, qwen2, qwen3) and GPT-2 also have a pipeline form.

FLOPs per token: 6N + 12*L*w*s (`hf_common`), N counted on the module built on the meta device.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from bigtrain.models import hf_common, hf_dir
from bigtrain.models.losses import causal_lm_loss, classification_loss
from bigtrain.models.family import DataFacts, Family
from bigtrain.models.spec import LayerDef, ModelSpec, classification_batch

log = logging.getLogger("bigtrain")


@dataclass(frozen=True)
class HFSettings:
    """Every field is a `build("hf", "custom", ...)` override key."""

    pretrained: str | None = None  # the local directory (config.json [+ weights, tokenizer])
    seq_len: int | None = None  # tokens per sample; default min(max positions, 2048)
    task: str | None = None  # "causal_lm" | "classify"; default decided from the directory
    num_classes: int | None = None  # classifier width; default the directory's num_labels
    vocab_size: int | None = None  # the data's tokenizer length: checked to fit the embedding
    pad_token_id: int | None = None  # the tokenizer's padding id (decoder classifiers find the last token by it)
    dropout: float | None = None  # every dropout rate the config has; None keeps the directory's
    attn_implementation: str | None = None  # None: sdpa where the class supports it, else its default (eager)
    trust_remote_code: bool = False  # run model code shipped in the directory (auto_map)

    def __post_init__(self) -> None:
        if not self.pretrained:
            raise ValueError("--model hf needs a local Hugging Face directory: --set model.pretrained=DIR")
        if self.task is not None and self.task not in hf_dir.TASKS:
            raise ValueError(f"hf task={self.task!r}: use one of {', '.join(hf_dir.TASKS)}")
        for key in ("seq_len", "num_classes", "vocab_size"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"hf {key}={value!r}: must be a positive integer")
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"hf dropout={self.dropout}: must be in [0, 1)")


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _configure(s: HFSettings, config: Any, task: str, cls: type) -> Any:
    """The directory's config with bigtrain's switches: classes, padding id, dropout, no KV cache, and the
    attention kernel (`hf_common.choose_attention`; one log line names it and why)."""
    if task == "classify":
        if s.num_classes is not None and s.num_classes != config.num_labels:
            config.num_labels = s.num_classes  # also resets id2label; a differently sized head starts fresh
        # A decoder's head reads each row at its last token that is not pad_token_id: it must be the id the data
        # pads with (the tokenizer's), or training reads a padding position a user's unpadded text never has.
        text, said = _text_config(config), getattr(_text_config(config), "pad_token_id", None)
        if s.pad_token_id is not None and said != s.pad_token_id:
            if said is not None:
                log.info("%s: pad_token_id %s -> %s, the tokenizer's pad that the rows are padded with",
                         s.pretrained, said, s.pad_token_id)
            text.pad_token_id = s.pad_token_id
    hf_common.set_dropout(config, s.dropout)
    kernel, why = hf_common.choose_attention(cls, s.attn_implementation)
    hf_common.set_training_defaults(config, kernel)
    log.info("%s: attention %s for %s (%s)", s.pretrained, kernel, cls.__name__, why)
    return config


def _check_shape(s: HFSettings, text: Any, seq_len: int) -> None:
    vocab = getattr(text, "vocab_size", None)
    if s.vocab_size is not None and vocab is not None and s.vocab_size > vocab:
        raise ValueError(f"the tokenizer has {s.vocab_size} tokens but {s.pretrained}'s model has {vocab} embedding "
                         "rows; train with the directory's own tokenizer (the default: leave data.tokenizer unset)")
    positions = getattr(text, "max_position_embeddings", None)
    if positions and seq_len > positions:
        raise ValueError(f"data.seq_len={seq_len} exceeds {s.pretrained}'s max_position_embeddings={positions}: "
                         f"use --set data.seq_len={positions} or less")


def model_class(config: Any, task: str, trust_remote_code: bool = False) -> type:
    """The concrete transformers class the Auto class would pick for this config."""
    from transformers.models.auto.auto_factory import _get_model_class, get_class_from_dynamic_module

    auto = hf_dir.auto_class(task)
    if type(config) in auto._model_mapping:
        return _get_model_class(config, auto._model_mapping)
    ref = (getattr(config, "auto_map", None) or {}).get(auto.__name__)
    if not (ref and trust_remote_code):
        raise ValueError(f"model_type {config.model_type!r} has no {auto.__name__} class; supported: {hf_dir.SUPPORTED}")
    return get_class_from_dynamic_module(ref, config.name_or_path)


def _layers(config: Any, task: str) -> list[LayerDef]:
    if task != "causal_lm":
        raise ValueError("pipeline stages are built for causal LMs (llama, mistral, qwen2, qwen3, gpt2); train this "
                         "classifier with pipeline.stages=1 (ZeRO shards it instead)")
    if config.model_type == "gpt2":
        from bigtrain.models.gpt2 import layer_defs as gpt2_layers
        return gpt2_layers(config)
    from bigtrain.models.decoder_pipe import layer_defs
    return layer_defs(config)


def _classify_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    return classification_loss(output.logits, labels)


def make_spec(size: str, fields: dict[str, Any]) -> ModelSpec:
    """Spec of the directory's model (see `HFSettings`); ValueError for what cannot be trained."""
    s = HFSettings(**fields)
    config = hf_dir.read_config(s.pretrained, trust_remote_code=s.trust_remote_code)
    task = s.task or hf_dir.task_of(config, s.pretrained)
    cls = model_class(config, task, s.trust_remote_code)  # reads only the config's type and auto_map
    config = _configure(s, config, task, cls)
    text = _text_config(config)
    positions = getattr(text, "max_position_embeddings", None) or 2048
    seq_len = s.seq_len or min(positions, 2048)
    _check_shape(s, text, seq_len)
    meta = hf_common.meta_module(cls, config)
    n_all = sum(p.numel() for p in meta.parameters())
    resized = hf_dir.resized_tensors(s.pretrained, {k: tuple(v.shape) for k, v in meta.state_dict().items()})
    per_token = hf_common.flops_per_token(hf_common.matmul_params(meta), text.num_hidden_layers,
                                          hf_common.attention_width(text), seq_len)
    weights = hf_dir.has_weights(s.pretrained)
    causal = task == "causal_lm"
    return ModelSpec(
        family="hf", size=size, config=config,
        construct=lambda: (hf_dir.load_pretrained(cls, s.pretrained, config, resized, **_load_kwargs(s)) if weights
                           else hf_common.construct_hf(cls, config)),
        init_module=hf_common.hf_init_fn(cls, config),
        layers=lambda: _layers(config, task),
        loss=hf_common.causal_loss_for(config) if causal else _classify_loss,
        pipeline_loss=causal_lm_loss if causal else classification_loss,
        batch_to_inputs=hf_common.text_batch("hf") if causal else classification_batch("hf classifier"),
        num_params=n_all, flops_per_sample=seq_len * per_token, tokens_per_sample=seq_len,
        modality="text" if causal else "classify",
        checkpoint_blocks=hf_common.decoder_blocks, enable_native_checkpointing=hf_common.native_checkpointing,
        pretrained=s.pretrained if weights else None, eval_metric="perplexity" if causal else "accuracy",
        hf_class=cls,
        seq_len=seq_len, vocab_size=getattr(text, "vocab_size", None), source_dir=s.pretrained,
        num_classes=None if causal else config.num_labels, weights_note=hf_dir.weights_note(s.pretrained),
    )


def _load_kwargs(s: HFSettings) -> dict:
    return {"trust_remote_code": True} if s.trust_remote_code else {}


def modality(fields: dict[str, Any]) -> str:
    """'text' or 'classify' for the directory in `fields["pretrained"]`, before any data is read."""
    s = HFSettings(**{k: v for k, v in fields.items() if k in HFSettings.__dataclass_fields__})
    config = hf_dir.read_config(s.pretrained, trust_remote_code=s.trust_remote_code)
    return "text" if (s.task or hf_dir.task_of(config, s.pretrained)) == "causal_lm" else "classify"


def data_overrides(family: Family, size: str, facts: DataFacts, pretrained: str | None) -> dict[str, Any]:
    """The directory's shape, the data's length, a tokenizer's vocabulary (resized embeddings), the labels' count
    for a classifier and the tokenizer's padding id."""
    derived: dict[str, Any] = {"pretrained": pretrained, "seq_len": facts.seq_len,
                               "vocab_size": facts.vocab_size or None}
    if facts.num_classes:
        derived["num_classes"] = facts.num_classes
    if isinstance(facts.pad_token_id, int):
        derived["pad_token_id"] = facts.pad_token_id
    return derived


FAMILY = Family(name="hf", settings_cls=HFSettings, sizes={}, make=make_spec, modality=modality,
                derive=data_overrides, parallel=frozenset({"zero", "pipeline", "tensor", "sequence", "expert"}))
