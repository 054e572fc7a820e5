"""The runner's view of the data: the run config mapped onto `bigtrain.data`, and what the model needs from it."""
from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

from bigtrain.checkpoint.state import ModelBuild
from bigtrain.config.run_config import DataConfig, ModelConfig, RunConfig
from bigtrain.data import DataBundle, batches, build_data, iter_eval_batches
from bigtrain.data.formats import PROMPT_FORMATS, ExampleOptions
from bigtrain.data.loader import by_length, trim_padding
from bigtrain.distributed.patient import patient_barrier
from bigtrain.distributed.world import World
from bigtrain.objectives import Needs

log = logging.getLogger("bigtrain")


def model_modality(model: ModelConfig) -> str:
    """'text' | 'classify' | 'image' for the model; checks a pretrained directory first (its model_type
    against --model, a trainable architecture), so a mismatch stops every rank before any data work."""
    from bigtrain import models
    return models.modality(model.family, {**model.overrides, "pretrained": model.pretrained})


def default_tokenizer(data: DataConfig, model: ModelConfig) -> str | None:
    """data.tokenizer, else the pretrained directory's own tokenizer (when it has one). Weights without a tokenizer
    are refused unless the data brings its own: a tokenizer trained here would feed them ids they never saw."""
    from bigtrain.models.hf_dir import has_tokenizer
    from bigtrain.models.names import has_weights

    if data.tokenizer is not None or not model.pretrained or not Path(model.pretrained).is_dir():
        return data.tokenizer
    if has_tokenizer(model.pretrained):
        return str(Path(model.pretrained).resolve())
    if has_weights(model.pretrained) and not _data_brings_tokenizer(data.source):
        raise ValueError(f"model.pretrained={model.pretrained!r} holds weights but no tokenizer (no tokenizer.json "
                         "or tokenizer_config.json there), and one trained here would give ids those weights never "
                         "saw: name the tokenizer they were trained with, --set data.tokenizer=DIR_OR_HUB_NAME, or "
                         "copy its files into that directory")
    return None


def _data_brings_tokenizer(source: str) -> bool:
    """Whether the data decides the token ids itself: prepared corpora (each has its tokenizer), random ids."""
    from bigtrain.data.mixture import parse_mixture
    from bigtrain.data.prepare.store import is_prepared
    if source == "synthetic":
        return True
    parts = parse_mixture(source)
    return all(is_prepared(path) for path, _ in parts) if parts else is_prepared(source)


class TrainingData:
    """Train/val data with a resumable order; the data-parallel shard is fixed when batches are first asked for."""

    def __init__(self, bundle: DataBundle, seed: int, tokenizer_dir: Path | None, longest: bool = False):
        self.bundle = bundle
        self.longest = longest  # each micro-batch cut after the last column it trains on (data.padding)
        self.seed = seed
        self.tokenizer_dir = tokenizer_dir
        self.sampler: Any = None  # a ResumableSampler, or a MixtureSampler for a data mixture
        self._pending_state: dict | None = None
        self._dp: tuple[int, int] = (0, 1)

    @property
    def tokenizer(self) -> Any:
        return self.bundle.tokenizer

    def set_data_parallel(self, dp_rank: int, dp_size: int) -> None:
        self._dp = (dp_rank, dp_size)

    def train_batches(self, micro_batch: int, step_batches: int = 1) -> Iterator[dict]:
        """Endless training batches of `micro_batch` records; `step_batches` > 1: each step's that many batches with
        their rows regrouped by length where they are cut to their longest (`bigtrain.data.loader.by_length`)."""
        rank, size = self._dp
        self.sampler = self.bundle.sampler(rank, size, self.seed)
        if self._pending_state is not None:
            self.sampler.load_state_dict(self._pending_state)
        stream = batches(self.bundle.train, self.sampler, micro_batch)
        return self._padded(by_length(stream, step_batches) if self.longest and step_batches > 1 else stream)

    def eval_batches(self, micro_batch: int, max_batches: int | None = None) -> Iterator[dict]:
        rank, size = self._dp
        return self._padded(iter_eval_batches(self.bundle.val, micro_batch, rank, size, max_batches))

    def _padded(self, stream: Iterator[dict]) -> Iterator[dict]:
        return (trim_padding(b) for b in stream) if self.longest else stream

    def state_dict(self) -> dict:
        assert self.sampler is not None, "state_dict() before training started"
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Applied when the sampler is made (after the engine fixed the data-parallel shard)."""
        self._pending_state = state
        if self.sampler is not None:
            self.sampler.load_state_dict(state)


def pads_to_longest(run: RunConfig) -> bool:
    """data.padding: auto pads to each micro-batch's longest row, but under pipeline stages or sequence parallelism."""
    if run.data.padding == "auto":
        return run.pipeline.stages == 1 and run.parallel.sequence == 1
    return run.data.padding == "longest"


def example_options(data: DataConfig, needs: Needs | None = None) -> ExampleOptions:
    """The data.* settings of records, with what the objective decides (`Needs`): prompt records (its layout
    "prompts", never detected: data.format=auto reads them so) leave data.seq_len - its completion_tokens to a
    prompt."""
    fmt, prompt_tokens = data.format, None
    if needs is not None and needs.layout == "prompts":
        fmt = PROMPT_FORMATS[0] if fmt == "auto" else fmt
        prompt_tokens = data.seq_len - needs.completion_tokens
    return ExampleOptions(fmt, data.chat_template, data.train_on_prompt, data.long_examples, data.packing,
                          prompt_tokens=prompt_tokens)


def build_training_data(data: DataConfig, model: ModelConfig, out_dir: Path, world: World, seed: int,
                        needs: Needs | None = None) -> TrainingData:
    """Rank 0 trains the tokenizer and prepares the token shards (local rank 0 too, where the cache is not shared
    with rank 0); the others wait and then memory-map them. `needs`: the objective's (how its records are read)."""
    tokenizer_dir = out_dir / "tokenizer"
    tokenizer = default_tokenizer(data, model)
    if needs is not None and needs.own_prompts and data.source == "builtin":  # no data given: the environment's
        return _own_prompts(data, tokenizer, seed)
    bundle = build_data(
        data.source, model_modality(model), seq_len=data.seq_len, tokenizer=tokenizer,
        vocab_size=data.vocab_size, tokenizer_dir=tokenizer_dir, cache_dir=out_dir / "data_cache",
        val_fraction=data.val_fraction, seed=seed,
        image_size=data.image_size, num_classes=data.num_classes, text_field=data.text_field,
        label_field=data.label_field, synthetic_samples=data.synthetic_samples, is_writer=world.is_main,
        barrier=patient_barrier(world.size), is_local_writer=world.local_rank == 0, split=data.split,
        revision=data.revision, streaming=data.streaming, hash_content=data.hash_content, num_proc=data.num_proc,
        examples=example_options(data, needs))
    if (data.chat_template or bundle.template_from_data) and bundle.tokenizer_dir is not None:
        # the prepared examples' tokenizer has the template (data.chat_template's, or a prepared corpus's own)
        return TrainingData(bundle, seed=seed, tokenizer_dir=bundle.tokenizer_dir)
    has_tokenizer_dir = bundle.tokenizer is not None and data.tokenizer is None
    if has_tokenizer_dir and tokenizer is not None:  # the pretrained directory's: export copies it from there
        tokenizer_dir = Path(tokenizer)
    elif has_tokenizer_dir and bundle.tokenizer_dir is not None:  # trained here, or a prepared corpus's own
        tokenizer_dir = bundle.tokenizer_dir
    return TrainingData(bundle, seed=seed, tokenizer_dir=tokenizer_dir if has_tokenizer_dir else None)


def _own_prompts(data: DataConfig, tokenizer: str | None, seed: int) -> TrainingData:
    """An objective's own prompts (bigtrain.data.prompt_rows.placeholder_prompts) with the run's tokenizer."""
    from bigtrain.data.prompt_rows import placeholder_prompts
    from bigtrain.data.tokenizer import load_tokenizer
    if tokenizer is None:
        raise ValueError("objective.environment without data: the prompts are rendered by the model's chat template, "
                         "and no tokenizer is given; set model.pretrained=DIR (with its tokenizer) or data.tokenizer")
    tok = load_tokenizer(tokenizer, data.chat_template)
    return TrainingData(placeholder_prompts(tok, data.val_fraction), seed=seed, tokenizer_dir=Path(tokenizer))


def overrides_for_run(run: RunConfig, bundle: DataBundle | None, device_name: str) -> dict:
    """The overrides the run builds its model with (`bigtrain.models.registry.model_overrides`: what the data
    decides, the objective's head, then the user's): from the data, or from the run config alone where no data is
    read (the launcher's memory check: the vocabulary of the BPE the run would train; a tokenizer named is not
    loaded, so its vocabulary is the model's default)."""
    from bigtrain.models.registry import DataFacts, model_overrides as overrides_of
    data, head = run.data, run.objective.declared.head
    if bundle is None:
        facts = DataFacts(seq_len=data.seq_len, vocab_size=data.vocab_size if data.tokenizer is None else None,
                          num_classes=data.num_classes)
    else:
        # a scalar head reads each row at its last token that is not the id the rows are padded with
        pad = getattr(bundle.tokenizer, "pad_token_id", None)
        if head == "scalar" and bundle.tokenizer is not None:
            from bigtrain.data.tokenizer import pad_id
            pad = pad_id(bundle.tokenizer)
        facts = DataFacts(seq_len=data.seq_len, vocab_size=bundle.vocab_size, num_classes=bundle.num_classes,
                          pad_token_id=pad if isinstance(pad, int) else None)
    model = run.model
    return overrides_of(model.family, model.size, facts, model.pretrained, model.overrides, device_name, head=head,
                        asked_by=f"objective.kind={run.objective.kind}")


def local_models(run: RunConfig, world: World, saved: ModelBuild | None) -> tuple[RunConfig, dict]:
    """The run config with model.pretrained and data.tokenizer as local directories (Hub names downloaded once per
    node, `bigtrain.models.hub`), and {"model"|"tokenizer": {repo_id, revision, commit}} for those from the Hub. A
    resumed run uses the commit its checkpoint recorded, wherever the branch points now."""
    from bigtrain.models.hub import is_hub_name, resolve_model_dir
    model, data, hub = run.model, run.data, {}
    if model.pretrained and (is_hub_name(model.pretrained) or model.revision):
        pinned = saved.hub if saved and saved.hub and saved.hub.get("repo_id") == model.pretrained else None
        source = resolve_model_dir(model.pretrained, pinned["commit"] if pinned else model.revision, world=world)
        hub["model"] = {**source.record(), **({"revision": pinned["revision"]} if pinned else {})}
        if world.is_main:
            log.info("model %s at commit %s%s: %s", source.repo_id, source.commit,
                     " (the checkpoint's)" if pinned else "", source.path)
        model = replace(model, pretrained=source.path, revision=None)
    if is_hub_name(data.tokenizer):
        source = resolve_model_dir(data.tokenizer, what="data.tokenizer", kind="tokenizer", world=world)
        hub["tokenizer"] = source.record()
        data = replace(data, tokenizer=source.path)
    return replace(run, model=model, data=data), hub
