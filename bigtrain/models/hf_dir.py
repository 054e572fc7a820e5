"""A local Hugging Face directory: what it holds (config, weights, tokenizer), which architecture
and task it is, and loading its weights. Every problem is one line naming the fix.

Task: a directory whose `architectures` name a `...ForSequenceClassification` is a classifier;
one naming a `...ForCausalLM` / `...LMHeadModel` is a causal LM; otherwise the `model_type`
decides: a causal LM if transformers has a causal-LM head for it and it is not a masked-LM
encoder (a BERT saved as `BertForMaskedLM` is fine-tuned as a classifier), else a classifier
if it has a sequence-classification head. Anything else is not trainable here.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bigtrain.models.names import WEIGHT_FILES, has_weights

log = logging.getLogger("bigtrain")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "tokenizer.model")
FAMILY_OF_TYPE = {"gpt2": "gpt2", "llama": "llama"}  # model types a named family builds; others: --model hf
TASKS = ("causal_lm", "classify")
SUPPORTED = ("causal LMs (AutoModelForCausalLM: llama, mistral, qwen2, gpt2, ...) and sequence classifiers "
             "(AutoModelForSequenceClassification: bert, roberta, ...)")


def has_tokenizer(path: str | Path) -> bool:
    return any((Path(path) / name).is_file() for name in TOKENIZER_FILES)


def raw_config(path: str | Path, setting: str = "model.pretrained") -> dict:
    """config.json as written; ValueError naming `setting` (what gave the directory) when the directory or the file
    is missing."""
    path = Path(path)
    if not (path / "config.json").is_file():
        what = "no such directory" if not path.is_dir() else "no config.json there"
        raise ValueError(f"{setting}={str(path)!r}: {what}; give a local directory written by "
                         "save_pretrained (config.json, model.safetensors, tokenizer files)")
    try:
        return json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path / 'config.json'} is not valid JSON ({err})") from err


def frozen_model_problem(path: str | Path, setting: str, head: str) -> str | None:
    """The line for a model held frozen beside the policy (`objective.teacher`, `objective.reward_model`) whose local
    directory is missing or is no such model: a reward model (`head` "scalar") is a sequence classifier with one
    label, and a causal LM there would score with a head of random weights."""
    path = Path(path).expanduser()
    flag = f"objective.{setting}={str(path)!r}"
    try:
        raw = raw_config(path, f"objective.{setting}")
    except ValueError as err:
        return str(err)
    if head != "scalar":
        return None
    archs = raw.get("architectures") or []
    if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
        return (f"{flag} holds a {archs[0]}, not a reward model, and would score with a head of random weights: give "
                "a sequence classifier with one label (what objective.kind=reward exports)")
    labels = len(raw.get("id2label") or {"0": "LABEL_0"})
    if labels != 1:
        return (f"{flag} is a classifier of {labels} labels; a reward model has one (num_labels=1, what "
                "objective.kind=reward exports)")
    return None


def read_config(path: str | Path, expect: str | None = None, trust_remote_code: bool = False) -> Any:
    """The directory's transformers config. `expect`: the model_type a named family (--model gpt2/llama) builds."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    raw = raw_config(path)
    model_type = raw.get("model_type")
    if expect is not None and model_type != expect:
        right = FAMILY_OF_TYPE.get(model_type, "hf")
        raise ValueError(f"{path} holds a {model_type!r} model but --model {expect} builds {expect!r} models; "
                         f"use --model {right}" + (" (or --model hf)" if right != "hf" else ""))
    if model_type not in CONFIG_MAPPING_NAMES and not trust_remote_code:
        why = ("its code ships in the directory (auto_map) and remote code is not allowed; pass "
               "--set model.overrides.trust_remote_code=true to run it") if raw.get("auto_map") else \
            "transformers does not know this architecture"
        raise ValueError(f"{path}: model_type {model_type!r} cannot be trained: {why}; supported: {SUPPORTED}")
    return AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)


def task_of(config: Any, path: str | Path) -> str:
    """'causal_lm' or 'classify' (module docstring); ValueError naming the model_type otherwise."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
                                                        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)

    archs = getattr(config, "architectures", None) or []
    model_type = config.model_type
    causal = model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or bool(getattr(config, "auto_map", None))
    classify = model_type in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES
    if any(a.endswith("ForSequenceClassification") for a in archs) and classify:
        return "classify"
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs) and causal:
        return "causal_lm"
    if causal and model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "causal_lm"
    if classify:
        return "classify"
    if is_vision_language(config):
        raise ValueError(f"{path} holds a {model_type!r} vision-language model ({', '.join(archs) or model_type}): "
                         "train it with --model vlm, which reads its images through the processor saved beside it")
    raise ValueError(f"{path}: model_type {model_type!r} ({', '.join(archs) or 'no architectures'}) has no "
                     f"causal-LM or sequence-classification head in transformers; supported: {SUPPORTED}")


def is_vision_language(config: Any) -> bool:
    """Whether transformers maps this config to `AutoModelForImageTextToText` (a model that reads images)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    return config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES and hasattr(config, "vision_config")


def auto_class(task: str) -> type:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    return AutoModelForCausalLM if task == "causal_lm" else AutoModelForSequenceClassification


def load_pretrained(model_cls: Any, path: str | Path, config: Any, drop: tuple[str, ...] = (), **kwargs: Any) -> nn.Module:
    """`from_pretrained` in fp32 with `config`'s training switches. Under ZeRO-3 (an HfDeepSpeedConfig
    alive, see bigtrain.parallel.zero_init) transformers loads straight into the partitioned weights.
    `drop`: checkpoint tensors to leave out (another shape than `config` builds, see `resized_tensors`).
    Modules whose weights the directory lacks or that were dropped (a classifier head of another
    width) are listed in `module.bigtrain_uninitialized` for bigtrain's seeded init."""
    state = _state_without(Path(path), set(drop)) if drop else None
    model, info = model_cls.from_pretrained(None if state is not None else str(path), config=config,
                                            local_files_only=True, dtype=torch.float32,
                                            attn_implementation=config._attn_implementation,
                                            output_loading_info=True, state_dict=state, **kwargs)
    missing = set(info.get("missing_keys") or []) | set(drop)
    model.bigtrain_uninitialized = {name.rsplit(".", 1)[0] for name in missing}
    if missing:
        log.info("%s: %d weights not in the checkpoint (or resized) start from random (%s)", path, len(missing),
                 ", ".join(sorted(model.bigtrain_uninitialized)[:4]))
    if hasattr(model, "lm_head"):
        model.loss_type = "ForCausalLM"  # transformers 5 may leave it None (then the HF Trainer rescales the loss)
    return model


def resized_tensors(path: str | Path, expected: dict[str, tuple[int, ...]]) -> tuple[str, ...]:
    """Checkpoint tensors whose shape differs from `expected` (name -> shape of the model to build): a
    classifier head of another width. They are dropped and start fresh: transformers' own
    `ignore_mismatched_sizes` is not honoured when it loads under ZeRO-3. Shapes come from file headers."""
    if not has_weights(path):
        return ()
    shapes = _shapes(_weight_index(Path(path)))
    return tuple(sorted(k for k, shape in shapes.items() if k in expected and expected[k] != shape))


def _state_without(path: Path, drop: set[str]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors but `drop`. As transformers does under ZeRO-3, only rank 0 reads the
    values; the other ranks hold meta tensors of the right shapes."""
    shapes = _shapes(_weight_index(path))
    keep = [k for k in shapes if k not in drop]
    reader = torch.distributed.get_rank() == 0 if torch.distributed.is_initialized() else True
    if reader:
        return read_tensors(path, keep)
    return {k: torch.empty(shapes[k], device="meta") for k in keep}


def _shapes(index: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(set(index.values())):
        names = [n for n, f in index.items() if f == file]
        if file.suffix == ".safetensors":
            from safetensors import safe_open
            with safe_open(str(file), "pt") as f:
                shapes.update({n: tuple(f.get_slice(n).get_shape()) for n in names})
        else:
            state = torch.load(file, map_location="meta", mmap=True, weights_only=True)
            shapes.update({n: tuple(state[n].shape) for n in names})
    return shapes


def weights_note(path: str | Path) -> str | None:
    """One line for a config-only directory, which trains from random weights."""
    if has_weights(path):
        return None
    return f"{path} has a config but no weights (no {' / '.join(WEIGHT_FILES[::2])}): starting from random weights"


def _weight_index(path: Path) -> dict[str, Path]:
    """Tensor name -> the file holding it (sharded or not, safetensors or torch .bin)."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (path / index_name).is_file():
            mapping = json.loads((path / index_name).read_text())["weight_map"]
            return {name: path / file for name, file in mapping.items()}
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (path / single).is_file():
            return {name: path / single for name in _names_in(path / single)}
    raise ValueError(f"{path}: no weights ({', '.join(WEIGHT_FILES)})")


def _names_in(file: Path) -> list[str]:
    if file.suffix == ".safetensors":
        from safetensors import safe_open
        with safe_open(str(file), "pt") as f:
            return list(f.keys())
    return list(torch.load(file, map_location="cpu", mmap=True, weights_only=True))


def read_tensors(path: str | Path, names: list[str], strip_prefixes: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """The named tensors of a checkpoint directory, reading only those (a pipeline stage's layers).

    A name missing as such is looked up without one of `strip_prefixes` (checkpoints saved from the
    base model, e.g. GPT-2's 'h.0...' for 'transformer.h.0...'). ValueError lists what is missing.
    """
    path = Path(path)
    index = _weight_index(path)
    where: dict[str, str] = {}
    for name in names:
        candidates = [name] + [name[len(p):] for p in strip_prefixes if name.startswith(p)]
        found = next((c for c in candidates if c in index), None)
        if found is not None:
            where[name] = found
    missing = [n for n in names if n not in where]
    if missing:
        raise ValueError(f"{path} lacks {len(missing)} weight(s) this pipeline stage needs: {', '.join(missing[:4])}; "
                         "train it with pipeline.stages=1")
    out: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name, key in where.items():
        by_file.setdefault(index[key], []).append(name)
    for file, wanted in by_file.items():
        if file.suffix == ".safetensors":
            from safetensors import safe_open
            with safe_open(str(file), "pt") as f:
                out.update({n: f.get_tensor(where[n]) for n in wanted})
        else:
            state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
            out.update({n: state[where[n]] for n in wanted})
    return out
