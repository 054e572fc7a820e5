"""`export_checkpoint`: one training checkpoint -> a self-contained model directory, on CPU.

GPT-2, Llama and `hf` models become Hugging Face directories (`AutoModelForCausalLM` or
`AutoModelForSequenceClassification.from_pretrained(out)` and `AutoTokenizer.from_pretrained(out)`
load them offline; sharded safetensors above `max_shard_size`; a `vlm` model's directory loads with
`AutoModelForImageTextToText` and `AutoProcessor`, its processor saved whole); other families become
`model.safetensors` + `bigtrain_model.json` (see `load_exported`). A single process, no
process group; the checkpoint is only read.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bigtrain import models
from bigtrain.checkpoint.safe_load import checkpoint_loading
from bigtrain.config.run_config import LoraConfig
from bigtrain.export.locate import Located, locate_checkpoint
from bigtrain.export.lora import check_adapter_export, write_lora
from bigtrain.export.read import load_exported, reload_hf
from bigtrain.export.verify import largest_logit_difference
from bigtrain.export.weights import Consolidated, consolidate
from bigtrain.export.write import (
    MAX_SHARD_SIZE,
    check_not_an_input,
    check_out_dir,
    load_tokenizer,
    pad_like_the_model,
    staging_dir,
    write_hf,
    write_recipe,
    write_safetensors,
)
from bigtrain.data.vision import load_processor
from bigtrain.parallel.lora import saved_lora

log = logging.getLogger("bigtrain")


@dataclass
class ExportResult:
    """What was written, and from where."""

    out: Path
    checkpoint: Path
    layout: str
    format: str  # "huggingface" | "safetensors"
    num_params: int
    tokenizer: str | None
    notes: list[str] = field(default_factory=list)
    max_logit_diff: float | None = None  # the export reloaded vs the model written, on a fixed batch (0 in fp32)
    files: list[str] = field(default_factory=list)
    verified_by: str = ""  # how the export was loaded back for that comparison


def export_checkpoint(path: str | Path, out: str | Path, tag: str | None = None, force: bool = False,
                      tokenizer: str | None = None, trust_checkpoint: bool = False,
                      max_shard_size: str | int = MAX_SHARD_SIZE, adapter: bool = False) -> ExportResult:
    """Export the newest complete checkpoint under `path` (or `tag`) to the directory `out`.

    `tokenizer` overrides the run's own (its trained tokenizer dir, or data.tokenizer).
    ValueError for a user's mistake: see `locate_checkpoint` and `check_out_dir`, and a file that
    needs a type outside the allow-list unless `trust_checkpoint` (bigtrain.checkpoint.safe_load).
    A LoRA run (`lora.r` > 0) is exported merged, or with `adapter` as the peft adapter directory alone
    (`bigtrain.export.lora`).
    """
    found = locate_checkpoint(path, tag)
    out = Path(out).expanduser()
    check_out_dir(out, force, protected=found.tag_dir)
    mb = found.state.model_build.here()  # a Hub model's snapshot fetched again (its commit) where it is gone
    spec = models.build(mb.family, mb.size, **mb.overrides)
    lora = saved_lora(found.state.run_config)
    if adapter:
        check_adapter_export(spec, lora, found.tag_dir)
    tok_source = tokenizer_source(found, tokenizer) if spec.modality in ("text", "classify", "vision") else None
    check_not_an_input(out, {"the base model": mb.overrides.get("pretrained"), "the tokenizer": tok_source})
    # before the slow part: fail early. A vision-language model's processor is saved whole (its image processor, its
    # tokenizer, its chat template): AutoProcessor loads the export as it loaded the base.
    processor = load_processor(tok_source, "the run's processor") if tok_source and spec.modality == "vision" \
        else None
    tok = processor.tokenizer if processor is not None else load_tokenizer(tok_source) if tok_source else None
    if tok is not None:
        pad_like_the_model(tok, spec.config)
    saved = processor if processor is not None else tok
    with checkpoint_loading(found.tag_dir, trust_checkpoint):
        consolidated = consolidate(found.tag_dir, spec, found.state.pipeline_stages)
    hf = spec.hf_class is not None
    with staging_dir(out) as tmp:
        if lora is not None:
            return _export_lora(tmp, out, found, spec, consolidated, lora, tok, tok_source, max_shard_size, adapter,
                                saved)
        if hf:
            model = write_hf(tmp, spec, consolidated.tensors, tok, max_shard_size)
        else:
            model = write_safetensors(tmp, spec, consolidated.tensors)
        del consolidated.tensors  # the model holds the only copy now
        if saved is not None:
            saved.save_pretrained(str(tmp))
        result = ExportResult(out=out.resolve(), checkpoint=found.tag_dir, layout=consolidated.layout,
                              format="huggingface" if hf else "safetensors",
                              num_params=sum(p.numel() for p in model.parameters()), tokenizer=tok_source,
                              notes=consolidated.notes)
        write_recipe(tmp, _recipe(found, result))
        # Self-check before the directory goes live: reload it as a user would, compare logits.
        reloaded = reload_hf(tmp) if hf else load_exported(tmp)
        result.max_logit_diff = largest_logit_difference(model, reloaded, spec)
        result.verified_by = "from_pretrained" if hf else "load_exported"
        result.files = sorted(p.name for p in tmp.iterdir())
        write_recipe(tmp, {**_recipe(found, result), "verified_max_logit_diff": result.max_logit_diff})
    return result


def _export_lora(tmp: Path, out: Path, found: Located, spec: models.ModelSpec, consolidated: Consolidated,
                 lora: LoraConfig, tok: Any, tok_source: str | None, max_shard_size: str | int,
                 adapter: bool, saved: Any = None) -> ExportResult:
    """The LoRA run's merged model or adapter directory into the staging directory `tmp`, verified; `saved`: what is
    saved beside it (the tokenizer, or a vision-language model's processor)."""
    written = write_lora(tmp, spec, consolidated.tensors, lora, tok, max_shard_size, adapter_only=adapter,
                         hub=found.state.model_build.hub)
    del consolidated.tensors
    if saved is not None:
        saved.save_pretrained(str(tmp))
    result = ExportResult(out=out.resolve(), checkpoint=found.tag_dir, layout=consolidated.layout,
                          format=written.format, num_params=written.num_params, tokenizer=tok_source,
                          notes=[*consolidated.notes, *written.notes], max_logit_diff=written.max_logit_diff,
                          verified_by=written.verified_by)
    write_recipe(tmp, {**_recipe(found, result), "lora": asdict(lora),
                       "verified_max_logit_diff": written.max_logit_diff})
    result.files = sorted(p.name for p in tmp.iterdir())
    return result


def tokenizer_source(found: Located, override: str | None) -> str | None:
    """--tokenizer, else the tokenizer the run trained (saved beside it), else the one it named."""
    if override:
        return override
    trained = found.state.tokenizer_dir  # stored relative to the run: found where the run is now
    if trained:
        mb = found.state.model_build
        if not trained.is_dir() and mb is not None and mb.hub and trained.name == mb.hub["commit"]:
            return mb.here().overrides["pretrained"]  # the Hub model's own tokenizer, fetched again at its commit
        if not trained.is_dir():
            raise ValueError(f"the run's tokenizer directory {trained} is gone; pass --tokenizer DIR")
        return str(trained)
    named = (found.state.run_config.get("data") or {}).get("tokenizer")
    if not named:
        log.warning("export: the run recorded no tokenizer; pass --tokenizer DIR to include one")
    return named or None


def _recipe(found: Located, result: ExportResult) -> dict:
    """bigtrain_model.json: how to rebuild the model, and where the weights came from."""
    return {"format": result.format, "model_build": found.state.model_build.to_json(),
            "source": {"checkpoint": str(found.tag_dir), "step": found.state.step,
                       "layout": result.layout, "world_size": found.state.world_size,
                       "pipeline_stages": found.state.pipeline_stages},
            "num_params": result.num_params, "tokenizer": result.tokenizer, "notes": result.notes,
            "prompts": found.state.prompts}  # how training asked its prompts: `bigtrain generate` asks them so
