"""The model zoo's front door: the families (`bigtrain.models.family.Family`) and what the rest of bigtrain asks
of them: `build(family, size, **overrides) -> ModelSpec`, the data a family trains on, the settings the data
decides, the vocabulary hint, the estimator's shape and the parallel modes.

This file only checks names and merges the named size with the overrides; value checks live in each
family's config. Family modules import `Family` from `family.py`, never this module: no import cycle.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from bigtrain.models.family import DataFacts, Family
from bigtrain.models.names import ALIASES, canonical
from bigtrain.models.spec import ModelSpec

__all__ = ["ALIASES", "DataFacts", "Family", "build", "build_directory", "canonical", "estimate_shape", "families",
           "family",
           "modality", "model_overrides", "size_settings", "slow_vocab_hint"]
GPU_VOCAB_MULTIPLE = 64


FAMILY_MODULES = ("encoder", "gpt2", "hf", "llama", "resnet", "vlm")  # bigtrain.models.NAME holds FAMILY, named NAME


def _families() -> dict[str, Family]:
    return {name: family(name) for name in FAMILY_MODULES}


def family(name: str) -> Family:
    """The family `name` (or its alias) names; ValueError listing the families for an unknown one. Only its own
    module is imported (each imports transformers' classes of its own: `bigtrain train` checks a model directory
    before any rank starts, and importing every family's took ~6 s more on a loaded machine)."""
    name = canonical(name)
    if name not in FAMILY_MODULES:
        raise ValueError(f"unknown model family {name!r}; choose one of: {', '.join(sorted(FAMILY_MODULES))}")
    found = importlib.import_module(f"bigtrain.models.{name}").FAMILY
    assert found.name == name, (found.name, name)
    return found


def families() -> dict[str, list[str]]:
    """Family name -> its named sizes (every family also accepts "custom")."""
    return {name: [*fam.sizes, "custom"] for name, fam in sorted(_families().items())}


def build(family_name: str, size: str, **overrides: Any) -> ModelSpec:
    """Build the spec of `family_name` at named `size`, with `overrides` applied to its settings.

    Raises ValueError naming the allowed values for an unknown family, size or override key.
    Size "custom" takes its whole shape from the overrides (or a pretrained directory). An override
    set to None means "the default" (e.g. data.num_classes left to the labels)."""
    fam = family(family_name)
    allowed_sizes = [*fam.sizes, "custom"]
    if not fam.sizes and size != "custom":
        raise ValueError(f"--model {fam.name} takes its shape from model.pretrained (a Hugging Face directory); "
                         f"drop --size {size}")
    if size not in allowed_sizes:
        raise ValueError(f"unknown size {size!r} for {fam.name}; choose one of: {', '.join(allowed_sizes)}")
    unknown = sorted(set(overrides) - set(fam.override_keys()))
    if unknown:
        raise ValueError(
            f"unknown override(s) {', '.join(unknown)} for {fam.name}; allowed: {', '.join(fam.override_keys())}")
    merged = {**fam.sizes.get(size, {}), **{k: v for k, v in overrides.items() if v is not None}}
    return fam.make(size, merged)


def modality(family_name: str, overrides: dict[str, Any]) -> str:
    """Which data the family trains on ('text', 'classify' or 'image'), known before the data is read (a
    pretrained directory is asked, and checked against the family)."""
    return family(family_name).modality(overrides)


def size_settings(family_name: str, size: str) -> dict[str, Any]:
    """A named size's settings merged over the family's defaults (empty for 'custom' but the defaults)."""
    return family(family_name).settings(size)


def model_overrides(family_name: str, size: str, facts: DataFacts, pretrained: str | None,
                    overrides: dict[str, Any], device_name: str, head: str = "own",
                    asked_by: str = "a scalar head") -> dict[str, Any]:
    """The overrides a job builds its model with: what the data decides, the head, then the user's (which win).
    The one place they are decided, for the run's model, the frozen models beside it and the estimates.

    On a GPU, a family that can pad its vocabulary pads it to a multiple of 64 (nanoGPT's 50257 -> 50304):
    GPT-2's odd 50257 rows sent the output layer's matmuls to a slow kernel, 31 of 80 GPU ms per step on an
    H100 (docs/benchmarks.md). The extra rows are never targets; pretrained shapes are left alone.

    `head`: "own" (the family's), or "scalar": the causal-LM directory with a one-label scalar head
    (AutoModelForSequenceClassification), which reads each row at its last token that is not `pad_token_id`: the
    id the rows are padded with (`facts.pad_token_id`, `bigtrain.data.tokenizer.pad_id`), also what the export's
    config.json says. `asked_by` names who wants it in the one line a family without such a
    head gets."""
    fam = family(family_name)
    pretrained = str(Path(pretrained).resolve()) if pretrained else None
    derived = fam.derive(fam, size, facts, pretrained)
    if fam.pads_vocabulary and not pretrained and device_name != "cpu":
        derived["vocab_multiple"] = GPU_VOCAB_MULTIPLE
    if head == "scalar":
        if not {"task", "num_classes"} <= set(fam.override_keys()):
            raise ValueError(f"{asked_by} puts a scalar head on the model: give a Hugging Face directory (--model hf "
                             "--set model.pretrained=DIR, a causal LM is loaded as AutoModelForSequenceClassification "
                             "with one label); this family has no such head")
        derived.update(task="classify", num_classes=1, pad_token_id=facts.pad_token_id)
    return {**derived, **overrides}


def build_directory(directory: str, seq_len: int | None, head: str = "own", asked_by: str = "a scalar head",
                    device_name: str = "cpu") -> ModelSpec:
    """A Hugging Face directory's model as it is (its shape, its weights) with `head`, for sequences of `seq_len`:
    a frozen model beside the one a run trains (a reward model, a teacher)."""
    overrides = model_overrides("hf", "custom", DataFacts(seq_len=seq_len or 0), directory, {}, device_name, head=head,
                                asked_by=asked_by)
    return build("hf", "custom", **overrides)


def slow_vocab_hint(spec: ModelSpec, device_name: str) -> str | None:
    """On a GPU, an output layer whose row count is no multiple of 64 runs on slow matmul kernels."""
    vocab = spec.vocab_size
    if (not family(spec.family).pads_vocabulary or vocab is None or vocab % GPU_VOCAB_MULTIPLE == 0
            or device_name == "cpu" or spec.source_dir):
        return None
    return (f"vocabulary of {vocab} rows (not a multiple of 64): the output layer's matmuls take slow kernels on "
            "GPUs; --set model.overrides.vocab_multiple=64 pads it (docs/benchmarks.md, On a GPU)")


def estimate_shape(spec: ModelSpec) -> dict[str, Any] | None:
    """The estimator's closed-form shape of `spec` (layers, hidden, heads, ...), or None: measure it."""
    shape = family(spec.family).analytic_shape
    return shape(spec) if shape is not None else None
