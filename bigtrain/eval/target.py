"""What `bigtrain eval TARGET` evaluates (and `bigtrain generate` / `chat` talk to): a run folder's checkpoint consolidated in memory, or a model directory.

A run folder (its --out, its checkpoints/ or one step_NNNNNN directory) is read the way `bigtrain export` reads it
(`bigtrain.export`: locate, consolidate, rebuild; a LoRA run's adapters merged the same way), but nothing is
written: the model lives in this process only. A Hugging Face directory (a `bigtrain export`, any local causal LM)
loads as lm-eval's `--model hf` loads it; a peft adapter directory (`bigtrain export --adapter`) on its base, merged.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

WHAT = ("give a run folder (a run's --out, its checkpoints/ or one step_NNNNNN directory), a Hugging Face model "
        "directory (config.json and weights, e.g. a `bigtrain export`) or a Hugging Face Hub name (org/name)")


@dataclass
class Target:
    """The model to evaluate (eval mode, on CPU), its tokenizer, and where its results go by default."""

    model: torch.nn.Module
    tokenizer: Any
    description: str  # one line for the console and the results file
    default_out: Path
    checkpoint: Path | None = None  # the tag directory of a run folder
    processor: Any = None  # a vision-language model's (its tokenizer is `tokenizer`): `bigtrain generate --image`
    prompts: str | None = None  # how its training data asked prompts ("chat_template", "text"), where a run recorded it


def target_kind(path: str | Path, tag: str | None = None, revision: str | None = None) -> str:
    """"model" (a model directory), "run" (a folder with bigtrain checkpoints) or "hub" (a Hub name), from the files
    alone and at once; ValueError (one line) for anything else."""
    from bigtrain.models.hub import is_hub_name
    directory = Path(path).expanduser()
    if is_hub_name(str(path)):
        if tag is not None:
            raise ValueError(f"--tag {tag}: {path} is a Hugging Face Hub model, not a run folder; drop --tag")
        return "hub"
    if revision is not None:
        raise ValueError(f"--revision {revision}: {path} is not a Hugging Face Hub name (org/name); drop --revision")
    if not directory.is_dir():
        raise ValueError(f"{path}: no such directory; {WHAT}")
    if (directory / "config.json").is_file() or (directory / "adapter_config.json").is_file():
        if tag is not None:
            raise ValueError(f"--tag {tag}: {path} is a model directory, not a run folder with checkpoints; drop --tag")
        return "model"
    from bigtrain.checkpoint.state import MARKER
    if not any(directory.glob(f"**/{MARKER}")):
        raise ValueError(f"{path}: neither a run folder (no checkpoint in it) nor a model directory (no config.json); "
                         f"{WHAT}")
    return "run"


def vision_target(path: str | Path, tag: str | None = None) -> bool:
    """Whether `path` holds a vision-language model, read from its files alone (a Hub name: not known here)."""
    import json

    from bigtrain.data.vision import has_processor
    kind = target_kind(path, tag)
    directory = Path(path).expanduser()
    if kind == "model":
        if not (directory / "config.json").is_file():  # an adapter: its processor saved beside it
            return has_processor(directory)
        raw = json.loads((directory / "config.json").read_text())
        from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
        return raw.get("model_type") in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES and "vision_config" in raw
    if kind == "run":
        from bigtrain.export.locate import locate_checkpoint
        from bigtrain.models.names import reads_images
        return reads_images(locate_checkpoint(directory, tag).state.model_build.family)
    return False


def load_target(path: str | Path, tag: str | None = None, tokenizer: str | None = None,
                trust_checkpoint: bool = False, revision: str | None = None, world: Any = None) -> Target:
    """The model at `path`; ValueError (one line) for anything that is not a run folder, a model directory or a Hub
    name. A Hub name (or a Hub --tokenizer) is downloaded once per node (`bigtrain.models.hub`): `world` when every
    rank of a launch loads it."""
    from bigtrain.models.hub import is_hub_name, resolve_model_dir
    kind = target_kind(path, tag, revision)
    if tokenizer and is_hub_name(tokenizer):
        tokenizer = resolve_model_dir(tokenizer, what="--tokenizer", kind="tokenizer", world=world).path
    if kind == "hub":
        source = resolve_model_dir(str(path), revision, what="TARGET", world=world)
        target = _model_directory(Path(source.path), tokenizer)
        target.description = f"Hub model {source.repo_id} at commit {source.commit[:12]}"
        target.default_out = Path("eval") / f"{source.repo_id.replace('/', '--')}.json"
        return target
    if kind == "model":
        return _model_directory(Path(path).expanduser().resolve(), tokenizer)
    return _run_folder(Path(path).expanduser(), tag, tokenizer, trust_checkpoint)


def _model_directory(directory: Path, tokenizer: str | None) -> Target:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from bigtrain.data.vision import has_processor, load_processor
    from bigtrain.export.write import load_tokenizer
    from bigtrain.models.hf_dir import is_vision_language
    adapter = (directory / "adapter_config.json").is_file() and not (directory / "config.json").is_file()
    vision = has_processor(tokenizer or directory) if adapter else \
        is_vision_language(AutoConfig.from_pretrained(str(directory), local_files_only=True))
    # before the weights: a directory without a tokenizer (a vision-language model's processor) fails at once
    processor = load_processor(tokenizer or directory, "TARGET") if vision else None
    tok = processor.tokenizer if processor is not None else load_tokenizer(tokenizer or str(directory))
    if adapter:
        from bigtrain.export.lora import load_adapter
        model = load_adapter(directory).merge_and_unload(safe_merge=True)
        what = f"peft adapter directory {directory}, merged into its base"
    else:
        config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
        _check_causal(config.architectures or [], str(directory))
        auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        # dtype "auto": the dtype the directory's config names, as lm-eval's `--model hf` loads it
        model = auto.from_pretrained(str(directory), local_files_only=True, dtype="auto")
        what = f"model directory {directory}"
    return Target(model.eval(), tok, what, directory / "eval_results.json", processor=processor,
                  prompts=_recorded_prompts(directory))


def _recorded_prompts(directory: Path) -> str | None:
    """How the run a `bigtrain export` came from asked its prompts (its bigtrain_model.json); None elsewhere."""
    import json

    from bigtrain.export.write import RECIPE
    try:
        return json.loads((directory / RECIPE).read_text()).get("prompts")
    except (OSError, ValueError, AttributeError):  # not an export of bigtrain's, or a recipe without it
        return None


def _run_folder(directory: Path, tag: str | None, tokenizer: str | None, trust_checkpoint: bool) -> Target:
    from bigtrain import models
    from bigtrain.checkpoint.safe_load import checkpoint_loading
    from bigtrain.export.exporter import tokenizer_source
    from bigtrain.export.locate import locate_checkpoint
    from bigtrain.export.weights import consolidate
    from bigtrain.export.write import empty_hf_model, load_into, load_tokenizer
    from bigtrain.parallel.lora import saved_lora

    found = locate_checkpoint(directory, tag)
    mb = found.state.model_build.here()  # a Hub model's snapshot fetched again (its commit) where it is gone
    spec = models.build(mb.family, mb.size, **mb.overrides)
    if spec.hf_class is None or spec.modality not in ("text", "vision"):
        raise ValueError(f"{found.tag_dir} holds a {mb.family} {spec.modality} model; evaluation (lm-eval) and "
                         "generation need a causal language model (gpt2, llama, or an hf causal LM)")
    source = tokenizer_source(found, tokenizer)
    if not source:
        raise ValueError(f"{found.tag_dir}: the run recorded no tokenizer; pass --tokenizer DIR")
    from bigtrain.data.vision import load_processor
    processor = load_processor(source, "the run's processor") if spec.modality == "vision" else None
    tok = processor.tokenizer if processor is not None else load_tokenizer(source)
    with checkpoint_loading(found.tag_dir, trust_checkpoint):
        consolidated = consolidate(found.tag_dir, spec, found.state.pipeline_stages)
    lora = saved_lora(found.state.run_config)
    what = f"run {found.ckpt_dir.parent if found.ckpt_dir.name == 'checkpoints' else found.ckpt_dir}, " \
           f"checkpoint {found.tag} ({consolidated.layout})"
    if lora is not None:
        from bigtrain.export.lora import trained_model
        # the same merge as `bigtrain export` (whole fp32 tensors, W + alpha/r B A), so both score alike
        model = trained_model(spec, consolidated.tensors, lora, tok).merge_and_unload(safe_merge=True)
        what += f", LoRA r={lora.r} merged"
    else:
        model = empty_hf_model(spec, tok)  # the config an export writes (KV cache on, special tokens)
        load_into(model, consolidated.tensors)
    del consolidated.tensors
    run_dir = found.ckpt_dir.parent if found.ckpt_dir.name == "checkpoints" else found.ckpt_dir
    return Target(model.eval(), tok, what, run_dir / "eval" / f"{found.tag}.json", found.tag_dir, processor,
                  found.state.prompts)


def _check_causal(architectures: list[str], where: str) -> None:
    if any(a.endswith(("ForSequenceClassification", "ForTokenClassification", "ForImageClassification"))
           for a in architectures):
        raise ValueError(f"{where} is a {architectures[0]}; evaluation (lm-eval) and generation need a causal "
                         "language model (AutoModelForCausalLM)")

