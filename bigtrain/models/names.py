"""Family names, light enough for the run config to use (no torch, no transformers)."""
from __future__ import annotations

ALIASES = {"transformer": "encoder"}  # the mission's "Transformer": the encoder classifier
SHAPE_FROM_DIRECTORY = frozenset({"hf"})  # families whose shape is a pretrained directory's, never a named size
# The data a family trains on when no directory is given, as its Family says (tests/unit/test_precheck.py holds the
# two together): known before any rank starts without importing the family's module and transformers' model classes.
MODALITY = {"gpt2": "text", "llama": "text", "encoder": "classify", "resnet": "image"}


def canonical(family: str) -> str:
    """The family an alias names (`transformer` -> `encoder`); other names unchanged."""
    return ALIASES.get(family, family)


def default_size(family: str, pretrained: str | None) -> str:
    """The size a run gets when it names none: a directory's own shape, else the family's "mini"."""
    return "custom" if pretrained or canonical(family) in SHAPE_FROM_DIRECTORY else "mini"
