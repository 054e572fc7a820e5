"""A model's logits at the positions that predict a completion's tokens: what the policy's loss, the old
policy's and the reference's log-probabilities and a distillation teacher's scores are all read from.

Prompts are left-padded, completions right-padded (bigtrain.rollout.generate's Rollout). Position ids count the
real tokens only (cumsum of the mask), as transformers' generate gives them while sampling: for rotary models this
changes nothing (a constant offset), for learned absolute positions (GPT-2) it is what makes these log-probs the
sampling distribution's.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """0, 1, 2, ... over each row's real tokens (padding gets 0), as generate's prepare_inputs does."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def completion_logits(module: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                      completion_ids: torch.Tensor, completion_mask: torch.Tensor, pixels: Any = None) -> torch.Tensor:
    """[N, C, V]: row i, position t holds the logits that predict completion_ids[i, t]. `module` is anything
    that is called like a transformers causal LM (a DeepSpeed engine, a peft model, a plain model); `pixels`: a
    vision-language model's image inputs of the rows (`bigtrain.models.pixels.PixelInputs`)."""
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    width = completion_ids.shape[1]
    kwargs = {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids(mask), "use_cache": False,
              **(pixels.inputs_for(ids) if pixels is not None else {})}
    if takes_logits_to_keep(module):
        kwargs["logits_to_keep"] = width + 1  # no [N, P, V] logits for the prompt's positions
    logits = module(**kwargs).logits
    return logits[:, -width - 1:-1, :]


def takes_logits_to_keep(module: Any) -> bool:
    """Whether the model computes the head on the last positions only when asked (transformers' logits_to_keep)."""
    return takes(module, "logits_to_keep")


def takes(module: Any, name: str) -> bool:
    """Whether the model's forward (a DeepSpeed engine's module's, a peft model's base's) has a parameter `name`."""
    target = getattr(module, "module", module)  # a DeepSpeed engine calls its module's forward
    target = target.get_base_model() if hasattr(target, "get_base_model") else target  # a peft model its base's
    try:
        return name in inspect.signature(target.forward).parameters
    except (TypeError, ValueError):
        return False
