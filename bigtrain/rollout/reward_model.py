"""A reward model directory as a reward function: a sequence classifier with one label (what bigtrain's
`objective.kind=reward` exports, or any AutoModelForSequenceClassification with num_labels=1), scoring a prompt
and its completion at the last token, as TRL's GRPOTrainer reads `logits[:, 0]`.

The text is re-tokenized with the reward model's own tokenizer (it need not be the policy's), laid out as the
reward model was trained on it by bigtrain (bigtrain.data.chat.Renderer: a plain prompt and its completion with
the tokenizer's start tokens and an end-of-text; a conversation through its chat template).

Which token is "last": transformers' *ForSequenceClassification reads the rightmost token that is not the
config's pad_token_id (modeling_layers.py), so rows are right-padded with exactly that id, the model's own,
which need not be the tokenizer's; a config without one gets the tokenizer's pad (else end-of-text) id, as
transformers otherwise refuses batches of more than one row. With pad == end-of-text the score is read at the
token before the final end-of-text, as in training, where the same rule picked it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class RewardModel:
    """`RewardModel(module, tokenizer, name)(prompts=..., completions=...)` -> one float per completion. `module`: the
    classifier, or the DeepSpeed engine around it (a frozen model beside the policy, every rank calling together)."""

    def __init__(self, module: Any, tokenizer: Any, name: str, batch_size: int = 8):
        self.module, self.tokenizer, self.batch_size = module, tokenizer, batch_size
        self.__name__ = name
        config = getattr(module, "module", module).config  # a DeepSpeed engine's `config` is its own: its module's
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        if getattr(config, "pad_token_id", None) is None:
            config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else \
                tokenizer.eos_token_id
        self.pad_id = int(config.pad_token_id)

    @classmethod
    def from_dir(cls, directory: Path, device: Any = None) -> "RewardModel":
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
        directory = Path(directory)
        try:
            config = AutoConfig.from_pretrained(directory)
            tokenizer = AutoTokenizer.from_pretrained(directory)
        except (OSError, ValueError) as e:
            raise ValueError(f"objective.rewards {str(directory)!r}: not a model directory with its tokenizer "
                             f"({str(e).splitlines()[0]})") from None
        if getattr(config, "num_labels", None) != 1:
            raise ValueError(f"objective.rewards {str(directory)!r}: a reward model has one output (num_labels=1); "
                             f"this one has {getattr(config, 'num_labels', None)} (train one with "
                             "objective.kind=reward)")
        module = AutoModelForSequenceClassification.from_pretrained(directory).eval()
        if device is None:
            from deepspeed.accelerator import get_accelerator
            device = get_accelerator().current_device_name()
        return cls(module.to(device), tokenizer, directory.name)

    def token_rows(self, prompts: list, completions: list) -> list[list[int]]:
        """Each prompt and completion as the reward model reads them (see the module's docstring)."""
        from bigtrain.data.chat import Renderer
        from bigtrain.rollout.builtin_rewards import completion_text
        rows = []
        for prompt, completion in zip(prompts, completions):
            if isinstance(prompt, list):
                if not getattr(self.tokenizer, "chat_template", None):
                    raise ValueError(f"reward model {self.__name__!r}: its tokenizer has no chat template, and the "
                                     "prompts are conversations; give the reward model's directory a template")
                answer = completion if isinstance(completion, list) else [{"role": "assistant",
                                                                           "content": completion_text(completion)}]
                ids, _ = Renderer(self.tokenizer, "chat").chat(prompt + answer)
            else:
                ids, _ = Renderer(self.tokenizer, "prompt_completion")({"prompt": prompt,
                                                                      "completion": completion_text(completion)})
            rows.append(ids)
        return rows

    @torch.no_grad()
    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float]:
        rows = self.token_rows(prompts, completions)
        device = next(self.module.parameters()).device
        scores: list[float] = []
        for start in range(0, len(rows), self.batch_size):
            chunk = rows[start:start + self.batch_size]
            width = max(map(len, chunk))
            ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, row in enumerate(chunk):
                ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
            logits = self.module(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
            scores.extend(logits[:, 0].float().tolist())
        return scores
