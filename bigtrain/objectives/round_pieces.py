"""A round of sampled completions as the step's micro-batches (`Piece`, `split_rollout`), what a step's micro-batches
share (`StepState`, its metrics as sums: `add_sums`), the rows of every rank (`gather_rows`) and the clock of a step's
parts (`Clock`): the parts of bigtrain.objectives.online's step that hold no objective."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bigtrain.objectives.base import Metrics

if TYPE_CHECKING:
    import torch


@dataclass
class Piece:
    """One micro-batch of a round: left-padded prompts, right-padded completions, and what the loss compares."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    advantages: torch.Tensor | None = None  # [rows]
    old_logps: torch.Tensor | None = None  # [rows, C] the policy's before the round's updates
    ref_logps: torch.Tensor | None = None  # [rows, C] the reference's
    pixels: Any = None  # a vision-language model's image inputs of the rows (bigtrain.models.pixels.PixelInputs)
    # [rows, C] with tools: 1 on every completion token the forward attends to (the tools' results too), while
    # completion_mask marks the model's own tokens, the only ones the loss and its counts see; None: the same
    context_mask: torch.Tensor | None = None
    # [rows] each row's place in the round's rollout, whose order the rewards and advantages follow (the pieces
    # may hold the rows in another: split_rollout's `order`, a shuffled round)
    index: torch.Tensor | None = None

    @property
    def rows(self) -> tuple:
        """What a forward over the rows takes: prompts, completions and the tokens attended to (and a
        vision-language model's images)."""
        attended = self.completion_mask if self.context_mask is None else self.context_mask
        rows = (self.prompt_ids, self.prompt_mask, self.completion_ids, attended)
        return rows if self.pixels is None else (*rows, self.pixels)

    def state(self) -> dict:
        return {k: v.state() if k == "pixels" else v for k, v in vars(self).items() if v is not None}


@dataclass
class StepState:
    """What a step's micro-batches share."""

    step_tokens: torch.Tensor  # the completion tokens of the whole step, over every rank (dapo's divisor)
    micro_batches: int  # accumulation steps x ranks: a share's divisor
    started: float  # when the policy part began
    sums: dict = field(default_factory=dict)  # the loss's metrics as (sum, count), over the step's micro-batches


class Clock:
    """Seconds between laps, the device synchronised first (its work is asynchronous)."""

    def __init__(self, device: Any):
        self.device = device
        self.last = time.perf_counter()

    def sync(self) -> None:
        if str(self.device) != "cpu":
            from deepspeed.accelerator import get_accelerator
            get_accelerator().synchronize()

    def lap(self) -> float:
        self.sync()
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        return seconds


def split_rollout(rollout: Any, pieces: int, order: torch.Tensor | None = None) -> list[Piece]:
    """A round's rows in `pieces` equal micro-batches, each trimmed to its longest prompt and completion; `order`:
    the rows in this order (a permutation of the rollout's rows; None: as they come)."""
    import torch

    from bigtrain.rollout.generation_batch import trim_bounds
    rows = rollout.completion_ids.shape[0]
    assert rows % pieces == 0, (rows, pieces)
    order = torch.arange(rows, device=rollout.completion_ids.device) if order is None else order
    size = rows // pieces
    context = getattr(rollout, "context_mask", None)  # a rollout with tools (bigtrain.rollout.agent)
    out = []
    for start in range(0, rows, size):
        part = order[start:start + size]
        pm, cm = rollout.prompt_mask[part], rollout.completion_mask[part]
        attended = None if context is None else context[part]
        left, right = trim_bounds(pm, cm, attended)
        pixels = None if rollout.pixels is None else rollout.pixels.take(part.tolist())
        out.append(Piece(rollout.prompt_ids[part, left:], pm[:, left:], rollout.completion_ids[part, :right],
                         cm[:, :right], pixels=pixels, context_mask=None if attended is None else attended[:, :right],
                         index=part))
    return out


def gather_rows(values: torch.Tensor, device: Any) -> torch.Tensor:
    """[n, k] of every rank, in rank order ([world x n, k]); every rank has the same n."""
    import torch
    values = values.to(device)
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return values
    parts = [torch.empty_like(values) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(parts, values.contiguous())
    return torch.cat(parts)


def reduce_sums_local(sums: dict) -> Metrics:
    """(sum, count) metrics as means of this rank's (an evaluation: the stepper averages them over ranks)."""
    return {name: float(total / count.clamp(min=1.0)) for name, (total, count) in sums.items()}


def add_sums(step: StepState, sums: dict) -> None:
    for name, (total, count) in sums.items():
        if name in step.sums:
            before = step.sums[name]
            step.sums[name] = (before[0] + total.detach(), before[1] + count)
        else:
            step.sums[name] = (total.detach(), count)
