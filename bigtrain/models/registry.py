"""The model zoo's front door: `build(family, size, **overrides) -> ModelSpec`.

Each family module declares a `FAMILY` (its named sizes, the override keys it accepts and
a `make(size, fields) -> ModelSpec`). This file only checks names and merges the named
size with the overrides; value checks live in each family's config.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable

from bigtrain.models.spec import ModelSpec


@dataclass(frozen=True)
class Family:
    """What the registry needs to know about a model family."""

    name: str
    settings_cls: type  # dataclass whose fields are the allowed override keys
    sizes: dict[str, dict[str, Any]]  # named size -> settings; "custom" is added by the registry
    make: Callable[[str, dict[str, Any]], ModelSpec]  # (size, merged settings) -> spec

    def override_keys(self) -> list[str]:
        return sorted(f.name for f in fields(self.settings_cls))


def _families() -> dict[str, Family]:
    # Imported lazily so that `import bigtrain.models` stays cheap (transformers is slow to import).
    from bigtrain.models import encoder, gpt2, hf, llama, resnet

    return {f.name: f for f in (encoder.FAMILY, gpt2.FAMILY, hf.FAMILY, llama.FAMILY, resnet.FAMILY)}


ALIASES = {"transformer": "encoder"}  # the mission's "Transformer": the encoder classifier


def canonical(family: str) -> str:
    """The family an alias names (`transformer` -> `encoder`); other names unchanged."""
    return ALIASES.get(family, family)


def families() -> dict[str, list[str]]:
    """Family name -> its named sizes (every family also accepts "custom")."""
    return {name: [*fam.sizes, "custom"] for name, fam in sorted(_families().items())}


def build(family: str, size: str, **overrides: Any) -> ModelSpec:
    """Build the spec of `family` at named `size`, with `overrides` applied to its settings.

    Raises ValueError naming the allowed values for an unknown family, size or override key.
    Size "custom" takes its whole shape from the overrides (or a pretrained directory). An override
    set to None means "the default" (e.g. data.num_classes left to the labels)."""
    fams = _families()
    family = canonical(family)
    if family not in fams:
        raise ValueError(f"unknown model family {family!r}; choose one of: {', '.join(sorted(fams))}")
    fam = fams[family]
    allowed_sizes = [*fam.sizes, "custom"]
    if not fam.sizes and size != "custom":
        raise ValueError(f"--model {family} takes its shape from model.pretrained (a Hugging Face directory); "
                         f"drop --size {size}")
    if size not in allowed_sizes:
        raise ValueError(f"unknown size {size!r} for {family}; choose one of: {', '.join(allowed_sizes)}")
    unknown = sorted(set(overrides) - set(fam.override_keys()))
    if unknown:
        raise ValueError(
            f"unknown override(s) {', '.join(unknown)} for {family}; allowed: {', '.join(fam.override_keys())}")
    merged = {**fam.sizes.get(size, {}), **{k: v for k, v in overrides.items() if v is not None}}
    return fam.make(size, merged)


MODALITY = {"gpt2": "text", "llama": "text", "encoder": "classify", "resnet": "image"}


def modality(family: str, overrides: dict[str, Any]) -> str:
    """Which data the family trains on ('text', 'classify' or 'image'), known before the data is read:
    `hf` asks the pretrained directory (a causal LM or a classifier)."""
    family = canonical(family)
    if family == "hf":
        from bigtrain.models.hf import modality as hf_modality
        return hf_modality(overrides)
    if family not in MODALITY:
        raise ValueError(f"unknown model family {family!r}; choose one of: {', '.join(sorted(_families()))}")
    return MODALITY[family]


def size_settings(family: str, size: str) -> dict[str, Any]:
    """A named size's settings merged over the family's defaults (empty for 'custom' but the defaults)."""
    fam = _families()[canonical(family)]
    defaults = {f.name: f.default for f in fields(fam.settings_cls) if not callable(f.default)}
    return {**defaults, **fam.sizes.get(size, {})}
