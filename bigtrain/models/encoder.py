"""A BERT-style Transformer encoder classifier in plain torch.

Post-LayerNorm blocks, learned positions, [CLS] (first token) pooling with a tanh pooler,
as BERT. Sizes follow Google's BERT releases (tiny 2x128 ... large 24x1024). Padded text
comes with an `attention_mask` (1 = token, 0 = padding): no position attends to padding, so
a text's logits do not depend on how much padding follows it. The plain module is built
from the very layers of the pipeline form; between pipeline stages the hidden states travel
with the mask as a tuple. `--model transformer` names this family too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bigtrain.models.losses import classification_loss
from bigtrain.models.family import DataFacts, Family
from bigtrain.models.spec import LayerDef, ModelSpec, classification_batch


@dataclass(frozen=True)
class EncoderConfig:
    """Every field is a `build("encoder", ...)` override key."""

    n_layer: int | None = None
    n_embd: int | None = None
    n_head: int | None = None
    vocab_size: int = 30522  # BERT's uncased WordPiece vocabulary
    n_positions: int = 512
    seq_len: int | None = None  # tokens per sample; default n_positions
    num_classes: int = 2
    dropout: float = 0.0
    layer_norm_eps: float = 1e-12

    def __post_init__(self) -> None:
        missing = [k for k in ("n_layer", "n_embd", "n_head") if getattr(self, k) is None]
        if missing:
            raise ValueError(f"encoder size 'custom' needs overrides {', '.join(missing)} "
                             "(e.g. n_layer=4, n_embd=256, n_head=4)")
        for key in ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions", "seq_len", "num_classes"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"encoder {key}={value!r}: must be a positive integer")
        if self.n_embd % self.n_head:
            raise ValueError(f"encoder n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.seq_len is None:
            object.__setattr__(self, "seq_len", self.n_positions)
        if self.seq_len > self.n_positions:
            raise ValueError(f"encoder seq_len={self.seq_len} exceeds n_positions={self.n_positions}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"encoder dropout={self.dropout}: must be in [0, 1)")


def init_module(module: nn.Module) -> None:
    """BERT's init for one module (applied by `bigtrain.models.init`, seeded by the module's name)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


Hidden = Any  # a tensor [B,T,C], or (tensor, attention_mask [B,T]) when the batch has padding


def _split(x: Hidden) -> tuple[torch.Tensor, torch.Tensor | None]:
    return (x[0], x[1]) if isinstance(x, (tuple, list)) else (x, None)


def _join(hidden: torch.Tensor, mask: torch.Tensor | None) -> Hidden:
    return hidden if mask is None else (hidden, mask)


class Embeddings(nn.Module):
    """Token + position embeddings, LayerNorm, dropout."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.positions = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.norm = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, inputs: Hidden) -> Hidden:
        input_ids, mask = _split(inputs)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return _join(self.drop(self.norm(self.tokens(input_ids) + self.positions(positions))), mask)


class EncoderBlock(nn.Module):
    """Post-LN block: x = LN(x + attn(x)); x = LN(x + mlp(x))."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.n_head, self.p_drop = cfg.n_head, cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.norm1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps)
        self.fc1 = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.fc2 = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.norm2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps)
        self.drop = nn.Dropout(cfg.dropout)

    def _attention(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, c // self.n_head).permute(2, 0, 3, 1, 4)
        keep = None if mask is None else mask.bool()[:, None, None, :]  # [B,1,1,T]: keys a query may attend
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=self.p_drop if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))

    def forward(self, inputs: Hidden) -> Hidden:
        x, mask = _split(inputs)
        x = self.norm1(x + self.drop(self._attention(x, mask)))
        return _join(self.norm2(x + self.drop(self.fc2(F.gelu(self.fc1(x))))), mask)


class ClassifierHead(nn.Module):
    """BERT pooler (dense + tanh on the first token) and the classifier."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.pooler = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.classifier = nn.Linear(cfg.n_embd, cfg.num_classes)

    def forward(self, inputs: Hidden) -> torch.Tensor:
        x, _ = _split(inputs)
        return self.classifier(self.drop(torch.tanh(self.pooler(x[:, 0]))))


class EncoderClassifier(nn.Module):
    """The plain module: input_ids [B,T] (+ attention_mask [B,T]) -> logits [B, num_classes]."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = Embeddings(cfg)
        self.blocks = nn.ModuleList(EncoderBlock(cfg) for _ in range(cfg.n_layer))
        self.head = ClassifierHead(cfg)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embeddings(_join(input_ids, attention_mask))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def num_params(cfg: EncoderConfig) -> int:
    """Embeddings + norm, 12h^2 + 13h per block, pooler and classifier."""
    h = cfg.n_embd
    embeddings = (cfg.vocab_size + cfg.n_positions) * h + 2 * h
    return embeddings + cfg.n_layer * (12 * h * h + 13 * h) + (h * h + h) + (h * cfg.num_classes + cfg.num_classes)


def flops_per_sample(cfg: EncoderConfig) -> float:
    """Training FLOPs per sequence of seq_len tokens: 3x the forward's matmul FLOPs.

    Forward per block: 2*T*12h^2 for the weight matmuls plus 4*T^2*h for the attention
    scores and weighted sum; then the pooler and classifier on one token. The embedding
    lookups are not matmuls; norms and activations are left out.
    """
    t, h = cfg.seq_len, cfg.n_embd
    forward = cfg.n_layer * (24 * t * h * h + 4 * t * t * h) + 2 * h * h + 2 * h * cfg.num_classes
    return 3.0 * forward


def layer_defs(cfg: EncoderConfig) -> list[LayerDef]:
    """Embeddings, every block, head: the same classes the plain module is made of."""
    return [
        LayerDef(Embeddings, (cfg,), param_map={"": "embeddings."}),
        *(LayerDef(EncoderBlock, (cfg,), param_map={"": f"blocks.{i}."}, checkpointable=True)
          for i in range(cfg.n_layer)),
        LayerDef(ClassifierHead, (cfg,), param_map={"": "head."}),
    ]


def _blocks(module: EncoderClassifier) -> list[tuple[nn.Module, str]]:
    return [(module.blocks, str(i)) for i in range(len(module.blocks))]


def make_spec(size: str, settings: dict[str, Any]) -> ModelSpec:
    """Encoder spec from merged settings (see `EncoderConfig`)."""
    cfg = EncoderConfig(**settings)
    return ModelSpec(
        family="encoder", size=size, config=cfg,
        construct=lambda: EncoderClassifier(cfg), init_module=init_module,
        layers=lambda: layer_defs(cfg),
        loss=classification_loss, pipeline_loss=classification_loss,
        batch_to_inputs=classification_batch("encoder"),
        num_params=num_params(cfg), flops_per_sample=flops_per_sample(cfg),
        tokens_per_sample=cfg.seq_len, modality="classify", checkpoint_blocks=_blocks, eval_metric="accuracy",
        seq_len=cfg.seq_len, vocab_size=cfg.vocab_size, num_classes=cfg.num_classes,
    )


def data_overrides(family: Family, size: str, facts: DataFacts, pretrained: str | None) -> dict[str, Any]:
    return {"vocab_size": facts.vocab_size, "num_classes": facts.num_classes, "seq_len": facts.seq_len}


def estimator_shape(spec: ModelSpec) -> dict[str, Any]:
    """The memory model's closed form for the encoder (`bigtrain.estimate.memory_model`)."""
    cfg = spec.config
    return dict(n_layer=cfg.n_layer, hidden=cfg.n_embd, heads=cfg.n_head, seq_len=cfg.seq_len,
                profile="encoder-sdpa", dropout=cfg.dropout)


FAMILY = Family(
    name="encoder",
    settings_cls=EncoderConfig,
    sizes={
        "tiny": {"n_layer": 2, "n_embd": 128, "n_head": 2},
        "mini": {"n_layer": 4, "n_embd": 256, "n_head": 4},
        "small": {"n_layer": 4, "n_embd": 512, "n_head": 8},
        "medium": {"n_layer": 8, "n_embd": 512, "n_head": 8},
        "base": {"n_layer": 12, "n_embd": 768, "n_head": 12},
        "large": {"n_layer": 24, "n_embd": 1024, "n_head": 16},
    },
    make=make_spec,
    modality=lambda overrides: "classify",
    derive=data_overrides,
    analytic_shape=estimator_shape,
)
