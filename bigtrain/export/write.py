"""Writing an export: a Hugging Face directory for the families built on transformers classes (gpt2,
llama, hf), safetensors + a rebuild recipe for bigtrain's own (encoder, resnet).

Everything goes to a temporary sibling directory that is renamed into place at the end,
so a crash never leaves a half export that looks complete.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from bigtrain.models import ModelSpec
from bigtrain.writable import unwritable

RECIPE = "bigtrain_model.json"
WEIGHTS = "model.safetensors"


def check_out_dir(out: Path, force: bool, protected: Path) -> None:
    """Refuse a non-empty `out` without --force, and any `out` that would touch the checkpoint."""
    out, protected = out.resolve(), protected.resolve()
    if out == protected or out in protected.parents or protected in out.parents:
        raise ValueError(f"--out {out} overlaps the checkpoint {protected}; export never writes there, "
                         "choose another directory")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a directory")
    if problem := unwritable(out.parent, "--out", named=out):  # the export is staged beside `out`, then renamed
        raise ValueError(problem)
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"--out {out} is not empty; choose a new directory or pass --force to replace it")


def check_not_an_input(out: Path, inputs: Mapping[str, str | Path | None]) -> None:
    """Refuse an `out` that is or holds one of the export's other inputs ({what: directory}: the base model an
    adapter loads on, the tokenizer), which --force would otherwise delete."""
    out = out.resolve()
    for what, path in inputs.items():
        path = Path(path).expanduser().resolve() if path else None
        if path is not None and path.is_dir() and (out == path or out in path.parents):
            raise ValueError(f"--out {out} would replace {what} {path}, which this export reads (and a user saved); "
                             "choose another directory")


@contextlib.contextmanager
def staging_dir(out: Path) -> Iterator[Path]:
    """Yield an empty temporary directory beside `out`; on success it replaces `out`, on error it goes."""
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        os.replace(out, old)  # move the old export aside first: the swap below is then a plain rename
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def load_into(model: nn.Module, tensors: Mapping[str, Any]) -> None:
    """Copy `tensors` (name -> tensor or lazy tensor with `.contiguous()`) into `model`, strictly.

    ValueError naming missing and unexpected keys and shape mismatches. A missing key is
    fine when it is an alias of a loaded one (tied weights share storage).
    """
    own = model.state_dict(keep_vars=True)
    missing = sorted(k for k in set(own) - set(tensors) if not _alias_loaded(own, k, tensors))
    unexpected = sorted(set(tensors) - set(own))
    shapes = [f"{k} {tuple(tensors[k].shape)} vs {tuple(own[k].shape)}"
              for k in sorted(set(own) & set(tensors)) if tuple(tensors[k].shape) != tuple(own[k].shape)]
    problems = [f"{label}: {', '.join(keys[:6])}{' ...' if len(keys) > 6 else ''}"
                for label, keys in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", shapes))
                if keys]
    if problems:
        raise ValueError(f"the checkpoint's weights do not fit the {type(model).__name__} rebuilt from its "
                         f"bigtrain.json ({'; '.join(problems)})")
    done: set[tuple[int, int]] = set()  # (source, target) pairs: a tied weight is copied once
    with torch.no_grad():
        for name, value in tensors.items():
            pair = (id(value), own[name].data_ptr())
            if pair not in done:
                own[name].copy_(value.contiguous())  # one parameter materialised at a time
                done.add(pair)
                if own[name].is_floating_point() and not bool(torch.isfinite(own[name]).all()):
                    raise ValueError(f"the checkpoint holds non-finite weights ({name} has NaN or infinite "
                                     "values): its run diverged before this save; export an earlier checkpoint "
                                     "with --tag")


def _alias_loaded(own: dict[str, torch.Tensor], key: str, tensors: Mapping[str, Any]) -> bool:
    ptr = own[key].data_ptr()
    return any(other in tensors and own[other].data_ptr() == ptr for other in own if other != key)


MAX_SHARD_SIZE = "5GB"  # transformers' own default: one file up to this size, then model-0000N-of-M.safetensors


def write_hf(out: Path, spec: ModelSpec, tensors: Mapping[str, Any], tokenizer: Any = None,
             max_shard_size: str | int = MAX_SHARD_SIZE) -> nn.Module:
    """`spec.hf_class(config).save_pretrained(out)`: config.json naming the trained architecture, and the
    weights as safetensors, sharded above `max_shard_size` (tied weights stored once, as HF expects)."""
    model = empty_hf_model(spec, tokenizer)
    load_into(model, tensors)
    model.save_pretrained(str(out), max_shard_size=max_shard_size)
    return model


def empty_hf_model(spec: ModelSpec, tokenizer: Any = None) -> nn.Module:
    """The trained architecture with uninitialised weights, its config as an export writes it.

    A self-trained vocabulary has no special-token ids in the config; they are taken from
    `tokenizer` then, so `generate` knows where text ends.
    """
    config = copy.deepcopy(spec.config)
    config.use_cache = True  # training turned the KV cache off; generation wants it
    config.architectures = [spec.hf_class.__name__]
    config.dtype = "float32"
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        token_id = getattr(tokenizer, attr, None)
        vocab = getattr(config, "vocab_size", None) or 0
        if getattr(config, attr, None) is None and isinstance(token_id, int) and token_id < vocab:
            setattr(config, attr, token_id)
    with no_init():  # every weight is overwritten; random init of a large model takes minutes
        model = spec.hf_class(config)
    model.tie_weights()  # skipped with the init; save_pretrained then stores a tied head once
    if getattr(model, "generation_config", None) is not None:
        model.generation_config = generation_config(spec, config, tokenizer)
    return model


def generation_config(spec: ModelSpec, config: Any, tokenizer: Any = None) -> Any:
    """What transformers' `generate` reads from an export: the pretrained directory's own generation_config.json
    (an instruct model's stop ids and sampling settings), else one made from the config; and among its stops the
    token the tokenizer's chat template closes a turn with, so that a chat model's answer ends where its turn does,
    as `bigtrain generate` ends it (TRL's clone_chat_template sets it so too)."""
    from transformers import GenerationConfig

    from bigtrain.data.chat import turn_end_ids
    own = Path(spec.pretrained) / "generation_config.json" if spec.pretrained else None
    gen = GenerationConfig.from_pretrained(str(own.parent)) if own is not None and own.is_file() else \
        GenerationConfig.from_model_config(config)
    eos = gen.eos_token_id
    stops = [eos] if isinstance(eos, int) else list(eos or [])
    vocab = getattr(config, "vocab_size", None) or 0
    added = [i for i in (turn_end_ids(tokenizer) if tokenizer is not None else []) if i < vocab and i not in stops]
    if added:
        gen.eos_token_id = [*stops, *added]
        gen._from_model_config = False  # else generate may rebuild it from config.json, without these stops
    return gen


def no_init() -> contextlib.AbstractContextManager:
    """transformers' switch that skips random weight init (for a model whose every weight is loaded next)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # another transformers version: initialise, only slower
        return contextlib.nullcontext()
    return no_init_weights()


def write_safetensors(out: Path, spec: ModelSpec, tensors: Mapping[str, Any]) -> nn.Module:
    """`model.safetensors` of the plain module (shared tensors stored once, as safetensors requires)."""
    from safetensors.torch import save_model

    model = spec.build()
    load_into(model, tensors)
    save_model(model, str(out / WEIGHTS))
    return model


def write_recipe(out: Path, recipe: dict) -> None:
    (out / RECIPE).write_text(json.dumps(recipe, indent=2))


def pad_like_the_model(tokenizer: Any, config: Any) -> None:
    """Give a tokenizer that has no pad token the model's (config.pad_token_id: what training padded with), so that a
    user's padded batch is read where training read its rows (transformers refuses to pad without one)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    pad = getattr(text, "pad_token_id", None)
    if tokenizer.pad_token_id is None and isinstance(pad, int) and 0 <= pad < len(tokenizer):
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(pad)


def load_tokenizer(source: str) -> Any:
    """The tokenizer at `source` (a local directory, or a hub name); ValueError if it cannot be loaded."""
    from transformers import AutoTokenizer

    from bigtrain.models.hf_dir import has_tokenizer
    path = Path(source).expanduser()
    if path.is_dir() and not has_tokenizer(path):  # transformers would load an empty tokenizer from it
        raise ValueError(f"{path} holds no tokenizer (no tokenizer.json or tokenizer_config.json); pass "
                         "--tokenizer DIR, the tokenizer the model was trained with")
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot load the run's tokenizer {source!r} ({str(err).splitlines()[0]}); "
                         "pass --tokenizer DIR") from err
