"""TRL's generation batch (GRPOConfig / RLOOConfig `generation_batch_size`, `steps_per_generation`): one round of
completions that serves one optimizer step or several.

In TRL a round holds `generation_batch_size` completions over all processes, `steps_per_generation` micro-batches
on each; by default one optimizer step's worth (steps_per_generation = gradient_accumulation_steps). A larger round
is generated in one go (a larger generation batch: fewer, fuller decode passes), its rows shuffled, and split into
the micro-batches of the next steps_per_generation / gradient_accumulation_steps optimizer steps, each on its own
share; the policy's log-probabilities are kept from before the round's first update (the later steps are off-policy
by then), and dapo divides each step's loss by the round's completion tokens over its steps. bigtrain does the same
(bigtrain.objectives.online), with rounds that cover whole optimizer steps: steps_per_generation a multiple of
batch.grad_accum.
"""
from __future__ import annotations

from dataclasses import fields, replace
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

P = TypeVar("P")
LEFT = ("prompt_ids", "prompt_mask")  # left-padded: cut and padded on the left
ROW = ("advantages", "pixels", "index")  # one value per row (a vision-language model's images: bigtrain.models.pixels)


def round_micro_batches(micro_batch: int, grad_accum: int, world: int, steps_per_generation: int | None,
                        generation_batch_size: int | None) -> int:
    """Micro-batches of one round on each rank (TRL's steps_per_generation): batch.grad_accum unless one of the two
    settings says otherwise; a one-line ValueError for a round that does not cover whole optimizer steps."""
    if steps_per_generation is not None and generation_batch_size is not None:
        raise ValueError("objective.generation_batch_size and objective.steps_per_generation both set: give one (TRL "
                         "refuses both too); the other follows from batch.micro_batch x ranks")
    if generation_batch_size is not None:
        per_micro = micro_batch * world
        if generation_batch_size % per_micro:
            raise ValueError(f"objective.generation_batch_size={generation_batch_size} is not a multiple of "
                             f"batch.micro_batch x ranks = {micro_batch} x {world}: a round is whole micro-batches "
                             "on every rank")
        steps_per_generation = generation_batch_size // per_micro
    count = steps_per_generation or grad_accum
    if count % grad_accum:
        what = (f"objective.generation_batch_size={generation_batch_size} ({count} micro-batches a rank)"
                if generation_batch_size is not None else f"objective.steps_per_generation={count}")
        raise ValueError(f"{what} with batch.grad_accum={grad_accum}: bigtrain's rounds cover whole optimizer steps; "
                         f"give a multiple of {grad_accum} micro-batches")
    return count


def shuffled(pieces: list[P], order: torch.Tensor, count: int) -> list[P]:
    """The rows of `pieces` (bigtrain.objectives.round_pieces.Piece) in `order`, cut again into `count` equal pieces, each
    trimmed to its longest prompt and completion: TRL shuffles a round's rows before splitting it into the steps it
    serves. Every per-row tensor (ids, masks, advantages, log-probabilities) moves with its row."""
    names = [f.name for f in fields(pieces[0]) if getattr(pieces[0], f.name) is not None]  # type: ignore[arg-type]
    rows = {name: _joined([getattr(p, name) for p in pieces], left=name in LEFT)[order] if name != "pixels"
            else _images([p.pixels for p in pieces], order) for name in names}
    size = len(order) // count
    out = []
    for start in range(0, len(order), size):
        part = {name: value[start:start + size] for name, value in rows.items()}
        left, right = trim_bounds(part["prompt_mask"], part["completion_mask"], part.get("context_mask"))
        out.append(replace(pieces[0], **{name: value if name in ROW else value[:, left:] if name in LEFT
                                         else value[:, :right] for name, value in part.items()}))
    return out


def trim_bounds(prompt_mask: torch.Tensor, completion_mask: torch.Tensor,
                context_mask: torch.Tensor | None = None) -> tuple[int, int]:
    """Where rows' shared padding ends on the prompts' left and begins on the completions' right: the first column any
    prompt uses, and the most completion tokens attended to (with tools the results too, `context_mask`, between the
    model's turns; at least 1)."""
    left = int((prompt_mask.sum(0) > 0).nonzero().min()) if prompt_mask.any() else 0
    attended = completion_mask if context_mask is None else context_mask
    return left, max(1, int(attended.sum(-1).max()))


def by_length(order: torch.Tensor, lengths: torch.Tensor, block: int) -> torch.Tensor:
    """`order` (rows of a round) with each run of `block` rows (one optimizer step's) sorted by `lengths`, stably:
    each step trains on the same rows, but its micro-batches, cut from them in turn, each hold rows of like lengths,
    so that one is trimmed to short completions instead of every one being padded to the longest. Rows per
    micro-batch stay equal; how a step's rows are split changes none of the loss types that divide by the step's
    tokens, by its rows or by its micro-batches x the (equal) rows each holds (`OnlineObjective.regroups`)."""
    keys = lengths.to(order.device)[order].view(-1, block)
    return order.view(-1, block).gather(1, torch.argsort(keys, dim=1, stable=True)).reshape(-1)


def row_lengths(prompt_mask: torch.Tensor, completion_mask: torch.Tensor,
                context_mask: torch.Tensor | None = None) -> torch.Tensor:
    """What `by_length` sorts rows by: the completion tokens attended to, then the prompt's tokens."""
    attended = (completion_mask if context_mask is None else context_mask).sum(-1)
    return attended * (prompt_mask.shape[1] + 1) + prompt_mask.sum(-1)


def _images(parts: list[Any], order: torch.Tensor) -> Any:
    """The pieces' image inputs (`bigtrain.models.pixels.PixelInputs`) as one, its rows in `order`."""
    joined = parts[0]
    for part in parts[1:]:
        joined = joined.then(part)
    return joined.take(order.tolist())


def _joined(parts: list[torch.Tensor], left: bool) -> torch.Tensor:
    """Pieces of different widths as one tensor of rows, padded with 0 (masked) on their padded side."""
    if parts[0].dim() == 1:
        return torch.cat(parts)
    width = max(t.shape[1] for t in parts)
    return torch.cat([F.pad(t, (width - t.shape[1], 0) if left else (0, width - t.shape[1])) for t in parts])


def steps_over(pieces: list[Any], grad_accum: int, taken: int) -> list[Any]:
    """The micro-batches of a round's `taken`-th step (0-based; over num_iterations the round's steps repeat)."""
    count = len(pieces) // grad_accum
    start = (taken % count) * grad_accum
    return pieces[start:start + grad_accum]
