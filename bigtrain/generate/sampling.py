"""Generation settings named as transformers names them, the prompt as the model reads it (its chat template for a
chat model), and one generation: transformers' own `generate`, with the model's generation_config under the flags.

With do_sample false the output is the greedy decoding transformers' `generate` gives on the same directory: the
same prompt ids, the same kernels, one prompt at a time (no padding).
"""
from __future__ import annotations

import argparse
import copy
import logging
from dataclasses import dataclass, fields
from typing import Any

log = logging.getLogger("bigtrain")
DEFAULT_MAX_NEW_TOKENS = 256


@dataclass(frozen=True)
class Sampling:
    """transformers' GenerationConfig fields a user sets (None: the model's generation_config.json, else
    transformers' default); `seed` seeds torch before each generation."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    do_sample: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    num_beams: int | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "top_k", "num_beams"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} {value}: must be >= 1")
        if self.temperature is not None and self.temperature <= 0:
            raise ValueError(f"--temperature {self.temperature}: must be > 0 (for greedy decoding: --do-sample false)")
        for name in ("top_p", "min_p"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 1:
                raise ValueError(f"--{name.replace('_', '-')} {value}: must be in (0, 1]")
        if self.do_sample is False and self.sampling_flags():
            flag = self.sampling_flags()[0]
            raise ValueError(f"--{flag.replace('_', '-')} with --do-sample false: greedy decoding ignores it; drop "
                             "one of them")

    def sampling_flags(self) -> list[str]:
        """The sampling settings given: giving one asks for sampling (transformers alone would drop it unless the
        model's generation_config samples, and decode greedily)."""
        return [name for name in ("temperature", "top_p", "top_k", "min_p") if getattr(self, name) is not None]

    def generation_config(self, model: Any, tokenizer: Any, stop_ids: list[int]) -> Any:
        """The model's generation_config with these settings over it, stopping at `stop_ids` too."""
        from transformers import GenerationConfig
        config = copy.deepcopy(getattr(model, "generation_config", None) or GenerationConfig())
        given = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "seed"}
        config.update(**{k: v for k, v in given.items() if v is not None})
        if self.do_sample is None and self.sampling_flags():
            config.do_sample = True
        if not config.do_sample:  # greedy: sampling settings the model's file names would only draw warnings
            config.update(temperature=None, top_p=None, top_k=None, min_p=None)
        eos = config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        config.eos_token_id = sorted(set(eos) | set(stop_ids)) or None
        if config.pad_token_id is None:
            config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else \
                (config.eos_token_id or [0])[0]
        return config


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """The flags, named as transformers' GenerationConfig names the fields."""
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                   help=f"tokens to generate at most (default {DEFAULT_MAX_NEW_TOKENS})")
    p.add_argument("--do-sample", nargs="?", const=True, default=None, type=_bool, metavar="true|false",
                   help="sample (true) or decode greedily (false); default: the model's generation_config.json, "
                        "else greedy")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the model's)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling: the smallest set of tokens with "
                                                             "this much probability (default: the model's)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens (default: the model's)")
    p.add_argument("--min-p", type=float, default=None, help="drop tokens below this share of the likeliest's "
                                                             "probability")
    p.add_argument("--repetition-penalty", type=float, default=None, help="penalty for tokens already seen (1: none)")
    p.add_argument("--num-beams", type=int, default=None, help="beam search with this many beams (1: none)")
    p.add_argument("--seed", type=int, default=None, help="seed torch before each generation (reproducible samples)")
    p.add_argument("--system", default=None, help="a system message before each conversation (chat models)")
    p.add_argument("--raw", action="store_true",
                   help="feed the prompt as plain text, not through the tokenizer's chat template")


def sampling_from_args(args: argparse.Namespace) -> Sampling:
    return Sampling(**{f.name: getattr(args, f.name) for f in fields(Sampling)})


def _bool(text: str) -> bool:
    value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(str(text).lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r}: give true or false")
    return value


def uses_template(tokenizer: Any, raw: bool) -> bool:
    """Whether prompts go through the tokenizer's chat template (it has one, and --raw was not given)."""
    return not raw and bool(getattr(tokenizer, "chat_template", None))


def prompt_ids(tokenizer: Any, messages: list[dict] | str, template: bool,
               tools: list[dict] | None = None) -> list[int]:
    """The ids the model reads: the conversation rendered by the chat template up to the assistant's turn (`tools`:
    the JSON schemas it shows), or the text tokenized as it is (with the tokenizer's own special tokens, as
    `tokenizer(text)` gives them)."""
    if template:
        conversation = [{"role": "user", "content": messages}] if isinstance(messages, str) else messages
        return list(tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False, tools=tools or None))
    text = messages if isinstance(messages, str) else "\n".join(m["content"] for m in messages)
    return tokenizer(text)["input_ids"]


def generate(model: Any, tokenizer: Any, ids: list[int], sampling: Sampling, config: Any, synced: bool = False,
             streamer: Any = None, extra: dict | None = None) -> list[int]:
    """The new token ids `model.generate` gives after `ids`. `synced`: every rank of a ZeRO-3 model calls this
    together (transformers' synced_gpus: the same number of forward passes on each). `extra`: more inputs of the
    prompt (a vision-language model's pixel values)."""
    import torch
    device = next(model.parameters()).device
    room = _positions(model)
    config = copy.deepcopy(config)
    if room and len(ids) + config.max_new_tokens > room:  # learned positions end there: generating past them fails
        config.max_new_tokens = max(1, room - len(ids))
    padding = range(len(tokenizer), model.config.get_text_config().vocab_size)  # a padded vocabulary's rows are never tokens
    if len(padding):
        config.suppress_tokens = list(padding)
    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    inputs = torch.tensor([ids], dtype=torch.long, device=device)
    dtype = next(model.parameters()).dtype  # the pixels in the weights' dtype (a bf16 export's)
    extra = {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in (extra or {}).items()}
    out = model.generate(inputs, attention_mask=torch.ones_like(inputs), generation_config=config,
                         synced_gpus=synced, streamer=streamer, **extra)
    return out[0, len(ids):].tolist()


def _positions(model: Any) -> int | None:
    """The length learned absolute positions allow (GPT-2-style configs name it `n_positions`); None for rotary
    positions, which have no table to run past."""
    return getattr(model.config, "n_positions", None)
