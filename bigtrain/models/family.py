"""`Family`: everything bigtrain knows of a model family, in one object.

Each family module declares one `FAMILY`: its settings and named sizes, how it builds a `ModelSpec`, which
data it trains on, which settings the data decides (vocabulary, classes, sequence length), the shape the
memory estimator reads, and which parallel modes it supports. Nothing outside `bigtrain.models` branches on a
family's name: it asks the family (`bigtrain.models.registry`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable

from bigtrain.models.spec import ModelSpec

# The ways bigtrain splits a model: ZeRO stages (every family), pipeline stages, and tensor, sequence and
# expert parallelism.
PARALLEL_MODES = ("zero", "pipeline", "tensor", "sequence", "expert")


@dataclass(frozen=True)
class DataFacts:
    """What the data says about a model's shape before it is built."""

    seq_len: int
    vocab_size: int | None = None  # the tokenizer's, when the data has one
    num_classes: int | None = None  # the labels', for classifiers
    pad_token_id: int | None = None


@dataclass(frozen=True)
class Family:
    """A model family: build, data, estimator shape and parallel modes."""

    name: str
    settings_cls: type  # dataclass whose fields are the allowed override keys
    sizes: dict[str, dict[str, Any]]  # named size -> settings; "custom" is added by the registry
    make: Callable[[str, dict[str, Any]], ModelSpec]  # (size, merged settings) -> spec
    modality: Callable[[dict[str, Any]], str]  # overrides (with "pretrained") -> "text" | "classify" | "image"
    derive: Callable[["Family", str, DataFacts, str | None], dict[str, Any]]
    """(family, size, data facts, pretrained directory) -> the overrides the data decides."""
    analytic_shape: Callable[[ModelSpec], dict[str, Any]] | None = None
    """The memory estimator's closed-form shape (layers, hidden, heads, ...); None: activations are measured."""
    parallel: frozenset[str] = field(default_factory=lambda: frozenset({"zero", "pipeline"}))

    def override_keys(self) -> list[str]:
        return sorted(f.name for f in fields(self.settings_cls))

    def settings(self, size: str) -> dict[str, Any]:
        """A named size's settings over the family's defaults (the defaults alone for "custom")."""
        defaults = {f.name: f.default for f in fields(self.settings_cls) if not callable(f.default)}
        return {**defaults, **self.sizes.get(size, {})}

    @property
    def pads_vocabulary(self) -> bool:
        """Whether the family can round its vocabulary up (`vocab_multiple`), for fast matmul kernels on GPUs."""
        return "vocab_multiple" in self.override_keys()


def decoder_overrides(family: Family, size: str, facts: DataFacts, pretrained: str | None) -> dict[str, Any]:
    """A decoder built here takes the tokenizer's vocabulary and room for the sequence; a pretrained one
    keeps the directory's shape."""
    if pretrained:
        return {"pretrained": pretrained, "seq_len": facts.seq_len}
    derived: dict[str, Any] = {"vocab_size": facts.vocab_size} if facts.vocab_size else {}
    derived["n_positions"] = max(family.settings(size).get("n_positions") or 1024, facts.seq_len)
    derived["seq_len"] = facts.seq_len
    return derived


def decoder_modality(model_type: str) -> Callable[[dict[str, Any]], str]:
    """A named decoder family trains on text; a pretrained directory must hold that family's model_type."""
    def modality(overrides: dict[str, Any]) -> str:
        if overrides.get("pretrained"):
            from bigtrain.models.hf_dir import read_config
            read_config(overrides["pretrained"], expect=model_type)
        return "text"
    return modality
