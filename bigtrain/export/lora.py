"""Exporting a LoRA run: the merged model as a Hugging Face directory, or the peft adapter directory alone.

Merging under ZeRO-3 is a known trap: inside the training job each rank holds a slice of every base weight, and
peft's merge on such a model merges into empty placeholders (peft issue #297) unless every weight is gathered
first. bigtrain's export never meets the trap: it works offline on the checkpoint, consolidated into whole fp32
tensors (the frozen base as saved, the adapters' fp32 masters), rebuilds the trained model on CPU with the same
adapters (`peft.get_peft_model`), and lets peft merge or save that. Each export verifies itself against the
trained model: the logits of the rebuilt base + adapters on a fixed batch against those of what was written,
loaded back as a user would (`from_pretrained`; `PeftModel.from_pretrained` on the base for an adapter).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from bigtrain.config.run_config import LoraConfig
from bigtrain.export.read import load_adapter, reload_hf
from bigtrain.export.verify import compare_logits, fixed_logits
from bigtrain.export.write import MAX_SHARD_SIZE, empty_hf_model, load_into
from bigtrain.models import ModelSpec
from bigtrain.parallel.lora import ADAPTER, peft_config

@dataclass(frozen=True)
class LoraWritten:
    """What `write_lora` wrote and how it checked it."""

    format: str  # "huggingface" (merged) | "peft-adapter"
    num_params: int  # of the merged model, or of the adapters
    max_logit_diff: float  # trained base + adapters vs what was written, reloaded
    verified_by: str
    notes: list[str]


def check_adapter_export(spec: ModelSpec, lora: LoraConfig | None, tag_dir: Path) -> None:
    """ValueError (one line) when `--adapter` cannot give a usable adapter directory."""
    if lora is None:
        raise ValueError(f"--adapter: {tag_dir} trained every weight (lora.r=0), so it has no adapter; export the "
                         "whole model without --adapter")
    if not spec.pretrained:
        raise ValueError("--adapter: the run's base model started from random weights (no model.pretrained "
                         "directory with weights), so an adapter alone cannot be loaded on it; export the merged "
                         "model without --adapter")


def trained_model(spec: ModelSpec, tensors: Mapping[str, Any], lora: LoraConfig, tokenizer: Any = None) -> Any:
    """The trained model on CPU in fp32: the base with the run's adapters (a `peft.PeftModel`), every tensor
    loaded strictly from the consolidated checkpoint (the adapters peft draws here are all overwritten)."""
    from peft import get_peft_model
    model = empty_hf_model(spec, tokenizer)
    peft_model = get_peft_model(model, peft_config(lora, model, spec.modality == "vision"), adapter_name=ADAPTER)
    load_into(peft_model.base_model.model, tensors)  # names as in training: `...q_proj.base_layer.weight`, ...
    return peft_model.eval()


def write_lora(out: Path, spec: ModelSpec, tensors: Mapping[str, Any], lora: LoraConfig, tokenizer: Any = None,
               max_shard_size: str | int = MAX_SHARD_SIZE, adapter_only: bool = False,
               hub: dict | None = None) -> LoraWritten:
    """Write the merged model (`save_pretrained`) or, with `adapter_only`, the adapter directory into `out`;
    both reloaded and compared with the trained model's logits. `hub`: the base came from the Hub
    ({repo_id, commit}): the adapter names it so (peft loads its base by name and revision), not by a cache path."""
    model = trained_model(spec, tensors, lora, tokenizer)
    trained = fixed_logits(model, spec)
    scale = f"alpha/r = {lora.alpha:g}/{lora.r}"
    if adapter_only:
        base = hub["repo_id"] if hub else str(Path(spec.pretrained).resolve())
        model.peft_config[ADAPTER].base_model_name_or_path = base  # what PeftModel.from_pretrained(DIR) loads
        model.peft_config[ADAPTER].revision = hub["commit"] if hub else None
        model.save_pretrained(str(out), safe_serialization=True)
        (out / "README.md").unlink(missing_ok=True)  # peft's empty model-card template
        num = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
        del model
        reloaded = load_adapter(out)
        return LoraWritten("peft-adapter", num, compare_logits(trained, fixed_logits(reloaded, spec)),
                           f"PeftModel.from_pretrained on the base {base}",
                           [f"LoRA adapter (r={lora.r}, {scale}); load it on its base with "
                            "peft.PeftModel.from_pretrained(base, DIR)"])
    merged = model.merge_and_unload(safe_merge=True)  # whole tensors here: W + (alpha/r) B A, nothing gathered
    merged.save_pretrained(str(out), max_shard_size=max_shard_size)
    num = sum(p.numel() for p in merged.parameters())
    del model, merged
    reloaded = reload_hf(out)
    return LoraWritten("huggingface", num, compare_logits(trained, fixed_logits(reloaded, spec)),
                       "from_pretrained, against the trained base + adapters",
                       [f"LoRA adapters (r={lora.r}, {scale}) merged into the base weights"])
