"""GPT-2 through transformers' `GPT2LMHeadModel`, and its pipeline form.

The plain module is HF's own model (built from a `GPT2Config`, or loaded from a local
directory), so HF checkpoints and tooling work unchanged. The pipeline form reuses HF's
`GPT2Block` for the blocks; the token embedding is one module shared (tied) by the first
layer and the output head, as in the plain model where `lm_head.weight is wte.weight`.

FLOPs: the standard training count per token is 6N + 12*L*h*s (Kaplan et al. 2020, PaLM
appendix B): 6N for the forward and backward of every weight matmul (2 FLOPs per
multiply-add, backward = 2x forward) and 12*L*h*s for the attention scores and the
weighted sum over s positions (causal attention counted as full, as kernels compute it).
N counts the weights that take part in a matmul: every parameter but the position
embeddings (the token embedding counts, as the tied output head). Biases and norms are in
N too (~0.1% of it at GPT-2 small).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.masking_utils import create_causal_mask
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from bigtrain.models import hf_common, hf_dir
from bigtrain.models.losses import causal_lm_loss
from bigtrain.models.family import Family, decoder_modality, decoder_overrides
from bigtrain.models.spec import LayerDef, ModelSpec

SHAPE_KEYS = ("n_layer", "n_embd", "n_head", "n_positions", "vocab_size")


@dataclass(frozen=True)
class GPT2Settings:
    """Every field is a `build("gpt2", ...)` override key."""

    n_layer: int | None = None
    n_embd: int | None = None
    n_head: int | None = None
    n_positions: int = 1024
    vocab_size: int = 50257
    seq_len: int | None = None  # tokens per sample; default n_positions
    # Pad the embedding / output vocabulary up to a multiple of this (nanoGPT's 50257 -> 50304). On an
    # H100, GPT-2's odd 50257 rows sent the output layer's matmuls to a slow kernel: 31 of 80 GPU ms per
    # step of GPT-2 small (docs/benchmarks.md). The extra rows are never targets; samples suppress them.
    vocab_multiple: int = 1
    dropout: float = 0.0  # residual, embedding and attention dropout
    # sdpa and eager give bit-identical plain and pipeline forms; sdpa's fused CPU kernel was
    # 20-30% faster fwd+bwd at seq 1024 and on par at 256 (gpt2 mini, 1 thread).
    attn_implementation: str = "sdpa"
    pretrained: str | None = None  # local directory saved with save_pretrained

    def __post_init__(self) -> None:
        missing = [k for k in ("n_layer", "n_embd", "n_head") if getattr(self, k) is None]
        if missing:
            raise ValueError(f"gpt2 size 'custom' needs overrides {', '.join(missing)} "
                             "(e.g. n_layer=4, n_embd=256, n_head=4), or pretrained=DIR")
        for key in (*SHAPE_KEYS, "seq_len"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"gpt2 {key}={value!r}: must be a positive integer")
        if not isinstance(self.vocab_multiple, int) or self.vocab_multiple < 1:
            raise ValueError(f"gpt2 vocab_multiple={self.vocab_multiple!r}: must be a positive integer (64 on GPUs)")
        if self.pretrained and self.padded_vocab != self.vocab_size:
            raise ValueError(f"gpt2 vocab_multiple={self.vocab_multiple} would pad the pretrained vocabulary "
                             f"{self.vocab_size} to {self.padded_vocab} rows, which its weights do not have; "
                             "leave vocab_multiple at 1 with pretrained")
        if self.n_embd % self.n_head:
            raise ValueError(f"gpt2 n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.seq_len is not None and self.seq_len > self.n_positions:
            raise ValueError(f"gpt2 seq_len={self.seq_len} exceeds n_positions={self.n_positions}: "
                             f"lower seq_len or raise n_positions")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"gpt2 dropout={self.dropout}: must be in [0, 1)")
        if self.attn_implementation not in ("sdpa", "eager"):
            raise ValueError(f"gpt2 attn_implementation={self.attn_implementation!r}: use 'sdpa' or 'eager'")


    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple


def _hf_config(s: GPT2Settings) -> GPT2Config:
    # GPT-2's <|endoftext|> is id 50256; a smaller (self-trained) vocabulary has no such id.
    eos = 50256 if s.vocab_size > 50256 else None
    cfg = GPT2Config(vocab_size=s.padded_vocab, n_positions=s.n_positions, n_embd=s.n_embd, n_layer=s.n_layer,
                     n_head=s.n_head, resid_pdrop=s.dropout, embd_pdrop=s.dropout, attn_pdrop=s.dropout,
                     bos_token_id=eos, eos_token_id=eos,
                     # GPT-2's tanh GELU as one fused kernel: gelu_new's formula in ~8 elementwise ops cost
                     # 1.7x the time on CPU and a measured share of every GPU step (docs/benchmarks.md).
                     activation_function="gelu_pytorch_tanh",
                     # Training needs no KV cache, and a recomputed (checkpointed) block would append to it twice.
                     use_cache=False)
    cfg._attn_implementation = s.attn_implementation  # the pipeline blocks read it from the config
    return cfg


def _with_pretrained_shape(size: str, fields: dict[str, Any]) -> dict[str, Any]:
    """Take the shape from the pretrained directory; a conflicting size/override is an error."""
    path = fields["pretrained"]
    saved = hf_dir.read_config(path, expect="gpt2")
    for key in SHAPE_KEYS:
        if key in fields and fields[key] != getattr(saved, key):
            raise ValueError(f"gpt2 size {size!r} / overrides set {key}={fields[key]} but {path} has "
                             f"{key}={getattr(saved, key)}; use size='custom' with pretrained to take its shape")
    return {**fields, **{key: getattr(saved, key) for key in SHAPE_KEYS}}


def build_model(cfg: GPT2Config, pretrained: str | None) -> GPT2LMHeadModel:
    """The plain module, fp32: loaded from `pretrained` (partitioned under ZeRO-3, see parallel.zero_init),
    or with its weights left for bigtrain's seeded init (`ModelSpec.build`)."""
    if pretrained:
        return hf_dir.load_pretrained(GPT2LMHeadModel, pretrained, cfg)
    return hf_common.construct_hf(GPT2LMHeadModel, cfg)


def num_params(cfg: GPT2Config) -> int:
    """Unique parameters (lm_head is tied to wte): embeddings + 12h^2 + 13h per block + final norm."""
    h = cfg.n_embd
    return cfg.vocab_size * h + cfg.n_positions * h + cfg.n_layer * (12 * h * h + 13 * h) + 2 * h


def flops_per_token(cfg: GPT2Config, seq_len: int) -> float:
    """Training FLOPs per token: 6N + 12*L*h*s, N = parameters without the position embeddings."""
    n = num_params(cfg) - cfg.n_positions * cfg.n_embd
    return 6.0 * n + 12.0 * cfg.n_layer * cfg.n_embd * seq_len


class TokenEmbedding(nn.Embedding):
    """wte: the first pipeline layer, and (tied, via `lm_head_forward`) the output head."""

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__(cfg.vocab_size, cfg.n_embd)


def lm_head_forward(embedding: TokenEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    """The output head: logits against the tied token-embedding matrix."""
    return F.linear(hidden, embedding.weight)


class PositionEmbedding(nn.Module):
    """Adds wpe and applies the embedding dropout, as GPT2Model does after the token lookup."""

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.drop = nn.Dropout(cfg.embd_pdrop)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
        return self.drop(tokens + self.wpe(positions))


class PipeBlock(GPT2Block):
    """HF's GPT2Block taking and returning one tensor, with the causal mask built inside.

    The mask comes from HF's own `create_causal_mask`, so it is the one the plain model
    uses (None with sdpa, which then runs its causal kernel). Its initial weights come from HF's
    GPT-2 init applied by `bigtrain.models.init` under the plain model's names.
    """

    def __init__(self, cfg: GPT2Config, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx=layer_idx)
        self.mask_config = cfg

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(config=self.mask_config, inputs_embeds=hidden, attention_mask=None,
                                  past_key_values=None, position_ids=positions)
        return super().forward(hidden, attention_mask=mask, position_ids=positions)


def layer_defs(cfg: GPT2Config) -> list[LayerDef]:
    """wte, wpe(+dropout), blocks, ln_f, tied head; run in sequence they equal GPT2LMHeadModel."""
    return [
        LayerDef(TokenEmbedding, (cfg,), param_map={"": "transformer.wte."}, tie_key="wte"),
        LayerDef(PositionEmbedding, (cfg,), param_map={"wpe.": "transformer.wpe."}),
        *(LayerDef(PipeBlock, (cfg, i), param_map={"": f"transformer.h.{i}."}, checkpointable=True)
          for i in range(cfg.n_layer)),
        LayerDef(nn.LayerNorm, (cfg.n_embd,), {"eps": cfg.layer_norm_epsilon}, param_map={"": "transformer.ln_f."}),
        LayerDef(TokenEmbedding, (cfg,), param_map={"": "lm_head."}, tie_key="wte", tie_forward=lm_head_forward),
    ]


def _module_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    return causal_lm_loss(output.logits, labels)


text_batch = hf_common.text_batch("gpt2")  # packed batches' position_ids index its learned positions (wpe)


def _blocks(model: GPT2LMHeadModel) -> list[tuple[nn.Module, str]]:
    return [(model.transformer.h, str(i)) for i in range(len(model.transformer.h))]


def _native_checkpointing(model: GPT2LMHeadModel, every_n: int = 1) -> None:
    model.activation_checkpointing_enable(every_n_layers=every_n)  # non-reentrant torch checkpoint


def make_spec(size: str, fields: dict[str, Any]) -> ModelSpec:
    """GPT-2 spec from merged settings (see `GPT2Settings`)."""
    if fields.get("pretrained"):
        fields = _with_pretrained_shape(size, fields)
    settings = GPT2Settings(**fields)
    cfg = _hf_config(settings)
    seq_len = settings.seq_len or settings.n_positions
    weights = settings.pretrained if settings.pretrained and hf_dir.has_weights(settings.pretrained) else None
    return ModelSpec(
        family="gpt2", size=size, config=cfg,
        construct=lambda: build_model(cfg, weights),
        init_module=hf_common.hf_init_fn(GPT2LMHeadModel, cfg),
        layers=lambda: layer_defs(cfg),
        loss=_module_loss, pipeline_loss=causal_lm_loss,
        batch_to_inputs=text_batch,
        num_params=num_params(cfg),
        flops_per_sample=seq_len * flops_per_token(cfg, seq_len),
        tokens_per_sample=seq_len, modality="text",
        checkpoint_blocks=_blocks, enable_native_checkpointing=_native_checkpointing,
        pretrained=weights, hf_class=GPT2LMHeadModel,
        seq_len=seq_len, vocab_size=cfg.vocab_size, source_dir=settings.pretrained,
    )


def estimator_shape(spec: ModelSpec) -> dict[str, Any]:
    """The memory model's closed form for GPT-2 (`bigtrain.estimate.memory_model`)."""
    cfg = spec.config
    attn = getattr(cfg, "_attn_implementation", None) or "sdpa"
    return dict(n_layer=cfg.n_layer, hidden=cfg.n_embd, heads=cfg.n_head, seq_len=spec.seq_len,
                vocab=cfg.vocab_size, profile=f"gpt2-{attn}", dropout=cfg.resid_pdrop)


FAMILY = Family(
    name="gpt2",
    settings_cls=GPT2Settings,
    sizes={
        "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 128},
        "mini": {"n_layer": 6, "n_embd": 384, "n_head": 6, "n_positions": 256},
        "small": {"n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024},
        "medium": {"n_layer": 24, "n_embd": 1024, "n_head": 16, "n_positions": 1024},
        "large": {"n_layer": 36, "n_embd": 1280, "n_head": 20, "n_positions": 1024},
        "xl": {"n_layer": 48, "n_embd": 1600, "n_head": 25, "n_positions": 1024},
    },
    make=make_spec,
    modality=decoder_modality("gpt2"),
    derive=decoder_overrides,
    analytic_shape=estimator_shape,
)
