"""Pipeline form of Llama-style decoders (llama, mistral, qwen2, qwen3): embedding, decoder layers,
final norm, output head (tied to the embedding or not).

The layers are transformers' own classes of that architecture. Each pipeline decoder layer
computes what the HF model computes once before its layers and hands to all of them: the
positions, the rotary cos/sin (a rotary module with buffers only, no weights) and the causal
mask (sliding-window where that architecture's layer uses one), so only the hidden states
travel between stages. Run in sequence, the layers equal `XForCausalLM`.
"""
from __future__ import annotations

import functools
import importlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from bigtrain.models.spec import LayerDef

PIPELINE_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def _classes(config: Any) -> tuple[type, type, type]:
    """(DecoderLayer, RMSNorm, RotaryEmbedding) of the config's architecture."""
    model_type = config.model_type
    if model_type not in PIPELINE_TYPES:
        raise ValueError(f"pipeline stages are built for model types {', '.join(PIPELINE_TYPES)} and gpt2, "
                         f"not {model_type!r}; train it with pipeline.stages=1 (ZeRO shards it instead)")
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    prefix = next(name[:-len("ForCausalLM")] for name in dir(module) if name.endswith("ForCausalLM"))
    return (getattr(module, f"{prefix}DecoderLayer"), getattr(module, f"{prefix}RMSNorm"),
            getattr(module, f"{prefix}RotaryEmbedding"))


def _uses_sliding_window(config: Any, idx: int) -> bool:
    """As the HF models decide: per layer from `layer_types` (Qwen2/3), else `sliding_window` (Mistral)."""
    types = getattr(config, "layer_types", None)
    if types:
        return types[idx] == "sliding_attention"
    return getattr(config, "sliding_window", None) is not None


@functools.cache
def pipe_layer_class(base: type) -> type:
    """`base` (an HF decoder layer) taking and returning the hidden states alone."""

    def __init__(self: Any, config: Any, idx: int, rotary_cls: type) -> None:
        base.__init__(self, config, idx)
        self.mask_config = config
        self.mask_fn = create_sliding_window_causal_mask if _uses_sliding_window(config, idx) else create_causal_mask
        self.rotary = rotary_cls(config=config)  # buffers only: cos/sin computed on this stage

    def forward(self: Any, hidden: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = self.mask_fn(config=self.mask_config, inputs_embeds=hidden, attention_mask=None,
                            past_key_values=None, position_ids=positions)
        cos_sin = self.rotary(hidden, position_ids=positions)
        return base.forward(self, hidden, attention_mask=mask, position_ids=positions, position_embeddings=cos_sin)

    return type(f"Pipe{base.__name__}", (base,), {"__init__": __init__, "forward": forward,
                                                  "__module__": __name__})


class TokenEmbedding(nn.Embedding):
    """model.embed_tokens (padding row as the HF model has it); with a tied head also the output layer."""

    def __init__(self, config: Any) -> None:
        super().__init__(config.vocab_size, config.hidden_size, config.pad_token_id)


def tied_head_forward(embedding: TokenEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    """The output head: logits against the tied token-embedding matrix."""
    return F.linear(hidden, embedding.weight)


class FinalNorm(nn.Module):
    """model.norm as its own layer (a wrapper so that its class name is stable for partitioning)."""

    def __init__(self, config: Any, norm_cls: type) -> None:
        super().__init__()
        self.norm = norm_cls(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden)


class OutputHead(nn.Linear):
    """lm_head of an untied model."""

    def __init__(self, config: Any) -> None:
        super().__init__(config.hidden_size, config.vocab_size, bias=False)


def layer_defs(config: Any) -> list[LayerDef]:
    """embed_tokens, every decoder layer, norm, lm_head (tied to embed_tokens when the config ties them)."""
    layer_cls, norm_cls, rotary_cls = _classes(config)
    pipe_cls = pipe_layer_class(layer_cls)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    embed = LayerDef(TokenEmbedding, (config,), param_map={"": "model.embed_tokens."},
                     tie_key="embed" if tied else None)
    if tied:
        head = LayerDef(TokenEmbedding, (config,), param_map={"": "lm_head."}, tie_key="embed",
                        tie_forward=tied_head_forward)
    else:
        head = LayerDef(OutputHead, (config,), param_map={"": "lm_head."})
    return [
        embed,
        *(LayerDef(pipe_cls, (config, i, rotary_cls), param_map={"": f"model.layers.{i}."}, checkpointable=True)
          for i in range(config.num_hidden_layers)),
        LayerDef(FinalNorm, (config, norm_cls), param_map={"norm.": "model.norm."}),
        head,
    ]
