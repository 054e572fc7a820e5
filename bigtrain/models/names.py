"""Family names and what a model directory holds, light enough for the run config to use (no torch, no
transformers)."""
from __future__ import annotations

from pathlib import Path

ALIASES = {"transformer": "encoder"}  # the mission's "Transformer": the encoder classifier
SHAPE_FROM_DIRECTORY = frozenset({"hf", "vlm"})  # families whose shape is a pretrained directory's, never a named size
# The data a family trains on when no directory is given, as its Family says (tests/unit/test_precheck.py holds the
# two together): known before any rank starts without importing the family's module and transformers' model classes.
MODALITY = {"gpt2": "text", "llama": "text", "encoder": "classify", "resnet": "image"}
READS_IMAGES = frozenset({"vlm"})  # families whose records carry images beside the text (modality "vision")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def canonical(family: str) -> str:
    """The family an alias names (`transformer` -> `encoder`); other names unchanged."""
    return ALIASES.get(family, family)


def reads_images(family: str) -> bool:
    """Whether a family's records carry images that its processor reads beside the text."""
    return canonical(family) in READS_IMAGES


def default_size(family: str, pretrained: str | None) -> str:
    """The size a run gets when it names none: a directory's own shape, else the family's "mini"."""
    return "custom" if pretrained or canonical(family) in SHAPE_FROM_DIRECTORY else "mini"


def has_weights(path: str | Path) -> bool:
    """Whether a Hugging Face directory holds weights (a config-only one trains from random weights)."""
    return any((Path(path) / name).is_file() for name in WEIGHT_FILES)


def starts_from_weights(pretrained: str | None) -> bool:
    """Whether a run starts from trained weights: a model.pretrained that is not a local directory without weight
    files (a name that is no local path is fetched with its weights)."""
    if not pretrained:
        return False
    return not Path(pretrained).is_dir() or has_weights(pretrained)
