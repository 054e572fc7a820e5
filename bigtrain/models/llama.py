"""Llama-architecture decoders through transformers' `LlamaForCausalLM`: RMSNorm, SwiGLU MLP,
rotary positions, grouped-query attention.

Named sizes: `tiny` and `mini` for tests and CPU demos, and the shapes of Llama 3.2 1B / 3B
and Llama 3.1 8B / 70B (`1b`, `3b`, `8b`, `70b`: the released configs' layers, widths, heads,
key/value heads, vocabulary, tying and llama3 rope scaling; random weights unless
`pretrained=DIR`). The plain module is HF's own model, so HF checkpoints and tools work
unchanged; the pipeline form is `bigtrain.models.decoder_pipe`.

FLOPs per token: 6N + 12*L*w*s (see `hf_common`), N = every parameter but the input embedding
of an untied model (a lookup); with a tied head the shared matrix counts once, as the head.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from transformers import LlamaConfig, LlamaForCausalLM

from bigtrain.models import hf_common
from bigtrain.models.decoder_pipe import layer_defs
from bigtrain.models.losses import causal_lm_loss
from bigtrain.models.family import Family, decoder_modality, decoder_overrides
from bigtrain.models.spec import ModelSpec

SHAPE_KEYS = {"n_layer": "num_hidden_layers", "n_embd": "hidden_size", "n_head": "num_attention_heads",
              "n_kv_head": "num_key_value_heads", "intermediate_size": "intermediate_size",
              "vocab_size": "vocab_size", "tie_embeddings": "tie_word_embeddings"}
LLAMA3_VOCAB = 128256


def _llama3_rope(factor: float) -> dict:
    return {"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class LlamaSettings:
    """Every field is a `build("llama", ...)` override key."""

    n_layer: int | None = None
    n_embd: int | None = None
    n_head: int | None = None
    n_kv_head: int | None = None  # key/value heads (grouped-query attention); default n_head
    intermediate_size: int | None = None  # SwiGLU width; default 8/3 * n_embd rounded up to 64
    vocab_size: int = LLAMA3_VOCAB
    n_positions: int = 2048  # max_position_embeddings
    seq_len: int | None = None  # tokens per sample; default min(n_positions, 2048)
    rope: dict | None = None  # rope_parameters; default plain rope with rope_theta
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    rms_norm_eps: float = 1e-5
    dropout: float = 0.0  # attention dropout
    attn_implementation: str = "sdpa"
    pretrained: str | None = None  # local directory of a Llama checkpoint (save_pretrained)

    def __post_init__(self) -> None:
        missing = [k for k in ("n_layer", "n_embd", "n_head") if getattr(self, k) is None]
        if missing:
            raise ValueError(f"llama size 'custom' needs overrides {', '.join(missing)} "
                             "(e.g. n_layer=4, n_embd=256, n_head=4, n_kv_head=2), or pretrained=DIR")
        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)
        if self.intermediate_size is None:
            object.__setattr__(self, "intermediate_size", -(-8 * self.n_embd // 3 // 64) * 64)
        for key in ("n_layer", "n_embd", "n_head", "n_kv_head", "intermediate_size", "vocab_size", "n_positions",
                    "seq_len"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"llama {key}={value!r}: must be a positive integer")
        if self.n_embd % self.n_head:
            raise ValueError(f"llama n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"llama n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head} "
                             "(grouped-query attention shares each key/value head among n_head/n_kv_head heads)")
        if self.seq_len is None:
            object.__setattr__(self, "seq_len", min(self.n_positions, 2048))
        if self.seq_len > self.n_positions:
            raise ValueError(f"llama seq_len={self.seq_len} exceeds n_positions={self.n_positions}: "
                             "lower seq_len or raise n_positions")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"llama dropout={self.dropout}: must be in [0, 1)")
        if self.attn_implementation not in ("sdpa", "eager"):
            raise ValueError(f"llama attn_implementation={self.attn_implementation!r}: use 'sdpa' or 'eager'")


def hf_config(s: LlamaSettings) -> LlamaConfig:
    """LlamaConfig for training (no KV cache). Llama 3's special ids only with Llama 3's vocabulary."""
    llama3 = s.vocab_size == LLAMA3_VOCAB
    rope = dict(s.rope) if s.rope else {"rope_type": "default", "rope_theta": float(s.rope_theta)}
    cfg = LlamaConfig(vocab_size=s.vocab_size, hidden_size=s.n_embd, intermediate_size=s.intermediate_size,
                      num_hidden_layers=s.n_layer, num_attention_heads=s.n_head, num_key_value_heads=s.n_kv_head,
                      max_position_embeddings=s.n_positions, rms_norm_eps=s.rms_norm_eps, rope_parameters=rope,
                      tie_word_embeddings=s.tie_embeddings, attention_dropout=s.dropout,
                      bos_token_id=128000 if llama3 else None, eos_token_id=128001 if llama3 else None)
    hf_common.set_training_defaults(cfg, s.attn_implementation)
    return cfg


def _with_pretrained(size: str, fields: dict[str, Any]) -> tuple[dict[str, Any], LlamaConfig]:
    """Shape from the directory's config; a conflicting size/override is an error."""
    from bigtrain.models.hf_dir import read_config

    path = fields["pretrained"]
    saved = read_config(path, expect="llama")
    for key, attr in SHAPE_KEYS.items():
        if key in fields and fields[key] != getattr(saved, attr):
            raise ValueError(f"llama size {size!r} / overrides set {key}={fields[key]} but {path} has "
                             f"{attr}={getattr(saved, attr)}; use size='custom' with pretrained to take its shape")
    shape = {key: getattr(saved, attr) for key, attr in SHAPE_KEYS.items()}
    shape["n_positions"] = saved.max_position_embeddings
    merged = {**fields, **shape, "rms_norm_eps": saved.rms_norm_eps}
    return merged, saved


def num_params(cfg: LlamaConfig) -> int:
    """Embedding (+ untied head), per layer q/k/v/o + SwiGLU (3 matrices) + 2 RMSNorms, final norm."""
    h, inner = cfg.hidden_size, cfg.intermediate_size
    head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    attn = h * head_dim * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    per_layer = attn + 3 * h * inner + 2 * h
    embeddings = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    return embeddings + cfg.num_hidden_layers * per_layer + h


def flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """6N + 12*L*w*s with N = parameters less the untied input embedding (a lookup)."""
    n = num_params(cfg) - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
    return hf_common.flops_per_token(n, cfg.num_hidden_layers, hf_common.attention_width(cfg), seq_len)


def make_spec(size: str, fields: dict[str, Any]) -> ModelSpec:
    """Llama spec from merged settings (see `LlamaSettings`)."""
    saved = None
    if fields.get("pretrained"):
        fields, saved = _with_pretrained(size, fields)
    settings = LlamaSettings(**fields)
    cfg = hf_config(settings)
    if saved is not None:  # the directory's config, with the training switches applied
        saved.attention_dropout = settings.dropout
        hf_common.set_training_defaults(saved, settings.attn_implementation)
        cfg = saved
    pretrained = settings.pretrained
    return ModelSpec(
        family="llama", size=size, config=cfg,
        construct=lambda: _construct(cfg, pretrained),
        init_module=hf_common.hf_init_fn(LlamaForCausalLM, cfg),
        layers=lambda: layer_defs(cfg),
        loss=hf_common.causal_module_loss, pipeline_loss=causal_lm_loss,
        batch_to_inputs=hf_common.text_batch("llama"),
        num_params=num_params(cfg),
        flops_per_sample=settings.seq_len * flops_per_token(cfg, settings.seq_len),
        tokens_per_sample=settings.seq_len, modality="text",
        checkpoint_blocks=hf_common.decoder_blocks, enable_native_checkpointing=hf_common.native_checkpointing,
        pretrained=_weights_dir(pretrained), hf_class=LlamaForCausalLM,
        seq_len=settings.seq_len, vocab_size=cfg.vocab_size, source_dir=pretrained,
    )


def _weights_dir(pretrained: str | None) -> str | None:
    """The directory when it holds weights; a config-only directory starts from random weights."""
    from bigtrain.models.hf_dir import has_weights

    return pretrained if pretrained and has_weights(pretrained) else None


def _construct(cfg: LlamaConfig, pretrained: str | None) -> LlamaForCausalLM:
    from bigtrain.models.hf_dir import load_pretrained

    if _weights_dir(pretrained):
        return load_pretrained(LlamaForCausalLM, pretrained, cfg)
    return hf_common.construct_hf(LlamaForCausalLM, cfg)


FAMILY = Family(
    name="llama",
    settings_cls=LlamaSettings,
    sizes={
        "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_kv_head": 2, "intermediate_size": 176,
                 "n_positions": 256},
        "mini": {"n_layer": 6, "n_embd": 384, "n_head": 6, "n_kv_head": 2, "intermediate_size": 1024,
                 "n_positions": 1024},
        "1b": {"n_layer": 16, "n_embd": 2048, "n_head": 32, "n_kv_head": 8, "intermediate_size": 8192,
               "n_positions": 131072, "tie_embeddings": True, "rope": _llama3_rope(32.0)},
        "3b": {"n_layer": 28, "n_embd": 3072, "n_head": 24, "n_kv_head": 8, "intermediate_size": 8192,
               "n_positions": 131072, "tie_embeddings": True, "rope": _llama3_rope(32.0)},
        "8b": {"n_layer": 32, "n_embd": 4096, "n_head": 32, "n_kv_head": 8, "intermediate_size": 14336,
               "n_positions": 131072, "rope": _llama3_rope(8.0)},
        "70b": {"n_layer": 80, "n_embd": 8192, "n_head": 64, "n_kv_head": 8, "intermediate_size": 28672,
                "n_positions": 131072, "rope": _llama3_rope(8.0)},
    },
    make=make_spec,
    modality=decoder_modality("llama"),
    derive=decoder_overrides,
    parallel=frozenset({"zero", "pipeline", "tensor", "sequence"}),
)
