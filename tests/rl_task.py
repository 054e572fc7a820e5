"""A verifiable task for online RL that a tiny model learns on a CPU in a few dozen steps: say the digit.

    prompt "say 3"  ->  answer "3"

A word-level tokenizer of 20 tokens (pad and end-of-text apart: `<pad>` is not `<eos>`), a tiny random Llama,
and TRL-style reward functions: `correct` (1.0 when the completion's first word is the answer), `digit_format`
(0.5 when it is a digit and the completion then ends): 1.5 at most. The random Llama below scores ~0.15 at first
(its last position already leans a little toward its own input token, through the tied embeddings). Mapping tasks
(the next digit, the parity) did not rise within 50 steps of the plain loop here; this one does. Used by
tests/unit/test_grpo_reference.py and, after the integration, to hold
`objective.kind=grpo` to the plain loop on the same model, prompts and seed.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

DIGITS = [str(d) for d in range(10)]
WORDS = ["<pad>", "<eos>", "<bos>", "say", "the", "is", ":", ".", *DIGITS, "a", "b"]


def make_tokenizer(directory: Path | None = None) -> Any:
    """A word-level tokenizer with a BOS put before every text, `<pad>` (0) apart from `<eos>` (1)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="a"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                  unk_token="a")
    if directory is not None:
        tok.save_pretrained(str(directory))
    return tok


def make_model(seed: int = 0, directory: Path | None = None) -> Any:
    """A tiny random Llama for the task's vocabulary (no dropout), saved to `directory` when given."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(WORDS), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=32, tie_word_embeddings=True, pad_token_id=0,
                                         bos_token_id=2, eos_token_id=1))
    if directory is not None:
        model.save_pretrained(directory)
    return model


def records(n: int, seed: int = 0) -> list[dict]:
    """{"prompt", "answer", "digit"} records, every digit equally often, in a seeded order."""
    g = torch.Generator().manual_seed(seed)
    digits = [i % 10 for i in range(n)]
    order = torch.randperm(n, generator=g).tolist()
    return [{"prompt": f"say {digits[i]}", "answer": str(digits[i]), "digit": digits[i]} for i in order]


def write_records(path: Path, n: int, seed: int = 0) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records(n, seed)))
    return path


def _first_word(completion: Any) -> str:
    text = completion if isinstance(completion, str) else completion[0]["content"]
    words = text.split()
    return words[0] if words else ""


def correct(completions: list, answer: list, **kwargs: Any) -> list[float]:
    """1.0 when the completion's first word is the record's answer."""
    return [float(_first_word(c) == a) for c, a in zip(completions, answer)]


def digit_format(completions: list, completion_ids: list, **kwargs: Any) -> list[float]:
    """0.5 when the completion is one digit and then its end-of-text (id 1)."""
    return [0.5 * float(c.split() == [_first_word(c)] and _first_word(c) in DIGITS and ids[-1:] == [1])
            for c, ids in zip(completions, completion_ids)]


REWARDS = [correct, digit_format]
