"""Reading an export back, as a user loads it: a Hugging Face directory through transformers' Auto class, a peft
adapter on its base, other models rebuilt from bigtrain_model.json with model.safetensors loaded strictly. The
writers verify what they wrote through these readers.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from bigtrain.export.write import RECIPE, WEIGHTS

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def reload_hf(directory: str | Path) -> nn.Module:
    """The Hugging Face export in `directory` through the Auto class its config's architecture names (a
    vision-language model's: AutoModelForImageTextToText)."""
    from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText,
                              AutoModelForSequenceClassification)

    from bigtrain.models.hf_dir import is_vision_language
    config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    classifier = any(a.endswith("ForSequenceClassification") for a in (config.architectures or []))
    auto = (AutoModelForSequenceClassification if classifier else AutoModelForImageTextToText
            if is_vision_language(config) else AutoModelForCausalLM)
    return auto.from_pretrained(str(directory), local_files_only=True, dtype=torch.float32).eval()


def load_exported(directory: str | Path) -> nn.Module:
    """The model of an export directory, in eval mode: transformers' Auto class for a Hugging Face export,
    else `bigtrain.models.build(...)` from bigtrain_model.json with model.safetensors loaded strictly."""
    directory = Path(directory)
    recipe_path = directory / RECIPE
    if not recipe_path.is_file():
        raise ValueError(f"{directory} is not a bigtrain export (no {RECIPE}); run `bigtrain export` first")
    recipe = json.loads(recipe_path.read_text())
    if recipe.get("format") == "peft-adapter":
        return load_adapter(directory).eval()
    if recipe.get("format") == "huggingface":
        model = reload_hf(directory)
    else:
        from safetensors.torch import load_model

        from bigtrain.models import build
        mb = recipe["model_build"]
        model = build(mb["family"], mb["size"], **mb.get("overrides", {})).build()
        load_model(model, str(directory / WEIGHTS), strict=True)
    return model.eval()


def load_adapter(directory: str | Path, base: str | Path | None = None) -> nn.Module:
    """An adapter export on its base (the directory or Hub name its adapter_config.json names, at its revision, or
    `base`), as a user loads it; ValueError (one line) when the base directory is gone."""
    from peft import PeftModel

    from bigtrain.models.hub import is_hub_name, resolve_model_dir
    directory = Path(directory)
    config = json.loads((directory / ADAPTER_FILES[0]).read_text())
    base = base or config.get("base_model_name_or_path")
    if base and is_hub_name(str(base)):
        base = resolve_model_dir(str(base), config.get("revision"), what="the adapter's base model").path
    if not base or not Path(base).is_dir():
        raise ValueError(f"the adapter in {directory} is for the base model {base}, which is not a directory here; "
                         "pass the base model directory")
    return PeftModel.from_pretrained(reload_hf(base), str(directory), torch_device="cpu").to(torch.float32).eval()
