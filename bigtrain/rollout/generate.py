"""Sampling completions from the policy being trained, on its DeepSpeed engine's own module.

    rng = SampleRNG(seed, rank, device)                       # saved with the checkpoint: rng.state_dict()
    rollout = generate(engine, tokenizer, prompt_ids, prompt_mask, Sampling(max_new_tokens=256, temperature=1.0,
                       num_generations=8), rng, gather=True, logps=True)

Prompts come left-padded with their mask; out come, for each prompt, `num_generations` completions in a row
(prompt 0's first: the groups the advantages are taken over), right-padded, masked after their first
end-of-text (which is kept), each marked truncated when max_new_tokens cut it, and optionally the per-token
log-probabilities of the sampling distribution (temperature applied), computed by one forward after generation.

With the weights left partitioned at ZeRO-3 (gather=False) each step's forward all-gathers the layers' weights on
every rank together, and a rank that stopped at its end-of-text early would leave the others waiting in that
gather for ever (DeepSpeed issue 8262). DeepSpeed's `runtime.rollout.HybridEngineRollout` (Sampling.decode=
"generate") calls `engine.module.generate` with `eos_token_id=None`, so every rank decodes exactly max_new_tokens
steps on every row, and masks what follows the first end-of-text afterwards; the compact decode (the default)
keeps the ranks in step until every rank's completions have ended, each on the rows still going
(bigtrain.rollout.decode, `synced`).

Where bigtrain does otherwise, and why:
- Gathered weights (ZeRO-3, gather=True, TRL's `ds3_gather_for_generation`, its default): DeepSpeed's
  `zero.stage3.unwrap_model_for_generation` gathers every parameter once and removes ZeRO-3's hooks for the
  round; HybridEngineRollout gathers once only for models with a DeepSpeed inference policy and the hybrid engine
  enabled (`DeepSpeedHybridEngine.generate`), which transformers models trained here do not have. With the
  weights whole on every rank (gathered, or ZeRO 0-2) no decode step needs another rank, so each rank stops at
  its own end-of-text: transformers' generate is called directly, and a round costs the longest completion's
  steps, not always max_new_tokens.
- The model's own generation_config.json (a repetition_penalty, a top_k of 20, a min_length) is set aside for
  the round: the completions must be drawn from exactly the distribution whose log-probabilities the loss uses.
- Sampling draws from a per-rank seeded stream (SampleRNG) instead of the process's global one, so that a resumed
  run samples what the uninterrupted run would have: transformers' generate takes no generator, so the device's
  default generator is swapped to this stream for the round and back after.
- The policy is put in eval mode for the round (no dropout; transformers skips gradient checkpointing in eval),
  and back after; a peft model generates with its adapters active.
- Several end-of-text ids (a model's generation_config may list more than the tokenizer's eos) all stop.
- A completion that ended leaves the batch and the KV cache (Sampling.decode="compact", bigtrain.rollout.decode):
  transformers' generate would decode it, on padding, until the round's longest ends.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Iterator

import torch

from bigtrain.rollout.forward import completion_logits
from bigtrain.rollout.losses import token_logps


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn (objective.max_completion_length, temperature, top_p, top_k, num_generations,
    decode). temperature <= 0 is greedy decoding; top_k 0 and top_p 1.0 leave the distribution whole; decode
    "compact" drops a completion that ended from the batch (bigtrain.rollout.decode), "generate" is transformers'."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    num_generations: int = 1
    decode: str = "compact"

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class Rollout:
    """Completions, in groups: rows g * n .. g * n + n - 1 answer prompt g."""

    prompt_ids: torch.Tensor  # [N, P] left-padded, each prompt repeated n times
    prompt_mask: torch.Tensor  # [N, P]
    completion_ids: torch.Tensor  # [N, C] right-padded with the pad id
    completion_mask: torch.Tensor  # [N, C] 1 up to and including the first end-of-text
    truncated: torch.Tensor  # [N] bool: no end-of-text within max_new_tokens
    logps: torch.Tensor | None = None  # [N, C] log-probs under the sampling distribution, 0 on padding
    pixels: Any = None  # a vision-language model's image inputs, each prompt's repeated for its completions

    @property
    def lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(-1)

    def masked_truncated(self) -> "Rollout":
        """objective.mask_truncated_completions (DAPO's overlong filtering, TRL's): a completion cut by
        max_new_tokens keeps its tokens but its mask is zeroed, so it is neither trained on, attended to in the
        loss's forward, nor counted among the step's tokens (dapo's normaliser)."""
        keep = (~self.truncated).long().unsqueeze(1)
        return Rollout(self.prompt_ids, self.prompt_mask, self.completion_ids, self.completion_mask * keep,
                       self.truncated, None if self.logps is None else self.logps * keep, self.pixels)

    def completion_lists(self) -> list[list[int]]:
        """Each completion's tokens, without padding (the end-of-text kept): TRL's completion_ids."""
        return [row[:n].tolist() for row, n in zip(self.completion_ids, self.lengths.tolist())]


class SampleRNG:
    """One rank's random stream for sampling: seeded from (seed, rank), its state saved with a checkpoint and
    restored on resume, apart from the process's global generators (which dropout and data order use)."""

    def __init__(self, seed: int, rank: int, device: torch.device | str):
        self.seed, self.rank, self.device = seed, rank, torch.device(device)
        generator = torch.Generator(device=self.device)
        generator.manual_seed((seed * 0x9E3779B1 + rank * 0x85EBCA6B + 1) % (1 << 63))
        self.state = generator.get_state()

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "rank": self.rank, "state": self.state.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed, self.rank, self.state = state["seed"], state["rank"], state["state"].clone()

    @contextmanager
    def active(self) -> Iterator[None]:
        """Inside, the device's default generator draws from this stream; outside, it is as it was."""
        if self.device.type == "cpu":
            saved = torch.get_rng_state()
            torch.set_rng_state(self.state)
            try:
                yield
            finally:
                self.state = torch.get_rng_state()
                torch.set_rng_state(saved)
            return
        from deepspeed.accelerator import get_accelerator
        accelerator, index = get_accelerator(), self.device.index
        saved = accelerator.get_rng_state(index)
        accelerator.set_rng_state(self.state, index)
        try:
            yield
        finally:
            self.state = accelerator.get_rng_state(index)
            accelerator.set_rng_state(saved, index)


def stop_ids(module: Any, tokenizer: Any) -> list[int]:
    """The ids that end a completion: the tokenizer's end-of-text and any the model's generation_config lists."""
    ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    configured = getattr(getattr(_base(module), "generation_config", None), "eos_token_id", None)
    for token in configured if isinstance(configured, (list, tuple)) else [configured]:
        if token is not None and int(token) not in ids:
            ids.append(int(token))
    if not ids:
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no end-of-text token: a "
                         "completion could never end; use a tokenizer that has one")
    return ids


def generate(engine: Any, tokenizer: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling,
             rng: SampleRNG, *, gather: bool = True, logps: bool = False, pixels: Any = None) -> Rollout:
    """One generation round on this rank (see the module's docstring). `engine`: a DeepSpeed engine (every rank
    calls this together at ZeRO-3), or a plain / peft model. `gather`: at ZeRO-3, gather the weights once for the
    round (they must fit one device) instead of gathering each layer at every decode step. `pixels`: a
    vision-language model's image inputs of the prompts (`bigtrain.models.pixels.PixelInputs`), which neither
    HybridEngineRollout nor the compact decode take: transformers' generate decodes instead (with the weights left
    partitioned, in step on every rank: synced_gpus)."""
    module = getattr(engine, "module", engine)
    partitioned = _zero3(engine)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stops = stop_ids(module, tokenizer)
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad(), _gathered(engine, partitioned and gather), _plain_generation_config(module, stops, pad), \
                rng.active():
            each = None if pixels is None else pixels.repeat_rows(sampling.num_generations)
            synced = partitioned and not gather  # every decode step gathers each layer on every rank together
            if sampling.decode == "compact" and each is None:  # a prompt's images: transformers' generate
                ids = _compact_steps(module, prompt_ids, prompt_mask, sampling, stops, pad, synced)
            elif synced and each is None:
                ids = _deepspeed_rollout(module, tokenizer, prompt_ids, prompt_mask, sampling)
            else:
                ids = _own_steps(module, prompt_ids, prompt_mask, sampling, stops, pad, each, synced=synced)
            rollout = _cut(prompt_ids, prompt_mask, ids, sampling, stops, pad)
            rollout.pixels = each
            if logps:
                rollout.logps = _logps(module, rollout, sampling)
    finally:
        module.train(was_training)
    return rollout


GATHER_SHARE = 0.5  # gathered weights may take at most this share of a device's free memory (the rest: KV cache)
GATHERED = "generation gathers the ZeRO-3 weights once per round"
PARTITIONED = "generation leaves the ZeRO-3 weights partitioned (one all-gather per layer and decode step)"


def gather_choice(engine: Any, setting: str | bool) -> tuple[bool, str]:
    """objective.ds3_gather_for_generation resolved on `engine`, and the start line's words for it ('' below ZeRO-3,
    where the weights are whole and there is nothing to gather). auto, a collective at ZeRO-3: gather the weights
    for a generation round when the whole model, in the dtype it trains in, takes at most half of the memory the
    fullest device has free now (DeepSpeed's `available_memory`; the other half is left to the KV cache and the
    round's activations); else leave them partitioned (one all-gather per layer and decode step: slower, but a model
    no device can hold whole still generates)."""
    if not _zero3(engine):
        return True, ""
    named = f"objective.ds3_gather_for_generation={str(setting).lower()}"
    if setting != "auto":
        return bool(setting), f"{GATHERED if setting else PARTITIONED} ({named})"
    from deepspeed.accelerator import get_accelerator

    from bigtrain.distributed.world import smallest_over_ranks
    module = getattr(engine, "module", engine)
    whole = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in module.parameters())
    free = smallest_over_ranks(float(get_accelerator().available_memory()))
    fits = whole <= GATHER_SHARE * free
    why = (f"the whole model, {_size(whole)}, takes {'at most' if fits else 'more than'} half of the {_size(free)} "
           "free on the fullest device" + ("" if fits else "; true gathers them anyway"))
    return fits, f"{GATHERED if fits else PARTITIONED} ({named}: {why})"


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _zero3(engine: Any) -> bool:
    check = getattr(engine, "zero_optimization_partition_weights", None)
    return bool(check()) if callable(check) else False


def _base(module: Any) -> Any:
    """The transformers model under a peft wrapper (whose generation_config is the one generate reads)."""
    return module.get_base_model() if hasattr(module, "get_base_model") else module


@contextmanager
def _gathered(engine: Any, gather: bool) -> Iterator[None]:
    if not gather:
        yield
        return
    from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation
    with unwrap_model_for_generation(engine):
        yield


@contextmanager
def _plain_generation_config(module: Any, stops: list[int], pad: int) -> Iterator[None]:
    """The model's generation_config replaced, for the round, by one holding only its special tokens."""
    from transformers import GenerationConfig
    base = _base(module)
    saved = getattr(base, "generation_config", None)
    bos = getattr(saved, "bos_token_id", None)
    base.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=stops, pad_token_id=pad)
    try:
        yield
    finally:
        base.generation_config = saved


def _deepspeed_rollout(module: Any, tokenizer: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                       sampling: Sampling) -> torch.Tensor:
    """DeepSpeed's HybridEngineRollout: every rank decodes max_new_tokens steps. Returns the completion ids."""
    from deepspeed.runtime.rollout import HybridEngineRollout, RolloutRequest, SamplingConfig
    config = SamplingConfig(max_new_tokens=sampling.max_new_tokens, temperature=max(sampling.temperature, 0.0),
                            top_p=sampling.top_p, top_k=sampling.top_k, n_samples_per_prompt=sampling.num_generations)
    batch = HybridEngineRollout(SimpleNamespace(module=module), tokenizer).generate(
        RolloutRequest(prompt_ids=prompt_ids, prompt_attention_mask=prompt_mask), config)
    return batch.input_ids[:, prompt_ids.shape[1]:]


def _own_steps(module: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling,
               stops: list[int], pad: int, pixels: Any = None, synced: bool = False) -> torch.Tensor:
    """transformers' generate, each rank stopping when its own completions have ended (`synced`: decoding in step
    with the others until all have, as partitioned weights need)."""
    n = sampling.num_generations
    ids, mask = prompt_ids.repeat_interleave(n, dim=0), prompt_mask.repeat_interleave(n, dim=0)
    kwargs: dict[str, Any] = {**drawing(sampling), **(pixels.inputs_for(ids) if pixels is not None else {})}
    # synced_gpus off: transformers would turn it on under ZeRO-3 (extra forwards until every rank is done),
    # which whole weights do not need
    out = module.generate(input_ids=ids, attention_mask=mask, max_new_tokens=sampling.max_new_tokens,
                          eos_token_id=stops, pad_token_id=pad, synced_gpus=synced, **kwargs)
    return out[:, prompt_ids.shape[1]:]


def _compact_steps(module: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling,
                   stops: list[int], pad: int, synced: bool = False) -> torch.Tensor:
    """bigtrain.rollout.decode's loop: the rows still decoding only, each rank stopping when its own have ended
    (`synced`: when every rank's have)."""
    from bigtrain.rollout.decode import compact_decode
    from bigtrain.rollout.forward import takes, takes_logits_to_keep
    n = sampling.num_generations
    return compact_decode(module, prompt_ids.repeat_interleave(n, dim=0), prompt_mask.repeat_interleave(n, dim=0),
                          sampling.max_new_tokens, stops, pad, greedy=sampling.greedy, temperature=sampling.temperature,
                          top_k=sampling.top_k, top_p=sampling.top_p, takes_logits_to_keep=takes_logits_to_keep(module),
                          cache_keyword="cache" if takes(module, "cache") else "past_key_values", synced=synced)


def drawing(sampling: Sampling) -> dict[str, Any]:
    """transformers' `generate` keywords that draw tokens as `sampling` says (greedy at temperature <= 0)."""
    if sampling.greedy:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k}


def _cut(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, ids: torch.Tensor, sampling: Sampling,
         stops: list[int], pad: int) -> Rollout:
    """Completions masked (and padded) after their first stop id, which is kept."""
    n = sampling.num_generations
    is_stop = torch.isin(ids, torch.tensor(stops, device=ids.device))
    ended = is_stop.any(dim=-1)
    first = torch.where(ended, is_stop.long().argmax(dim=-1), torch.full_like(ended, ids.shape[1], dtype=torch.long))
    positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    mask = (positions <= first.unsqueeze(1)).long()
    ids = ids.masked_fill(mask == 0, pad)
    return Rollout(prompt_ids.repeat_interleave(n, dim=0), prompt_mask.repeat_interleave(n, dim=0), ids, mask,
                   ~ended)


def _logps(module: Any, rollout: Rollout, sampling: Sampling) -> torch.Tensor:
    logits = completion_logits(module, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                               rollout.completion_mask, rollout.pixels)
    temperature = 1.0 if sampling.greedy else sampling.temperature
    return token_logps(logits, rollout.completion_ids, temperature) * rollout.completion_mask
