"""Sequence parallelism (DeepSpeed Ulysses / ALST) around a plain module's sdpa attention, from the outside.

Ulysses swaps the sdpa attention in transformers' attention table for an all-to-all around it; every rank of a
group takes its slice of each sample's sequence (with the positions of that slice), and the loss is summed over
the group's tokens here, weighted by the real (not ignored) tokens each rank holds. Ulysses drops the model's
attention mask (it was made for the local slice) and runs plain causal sdpa over the gathered sequence; packed
examples (position ids restarting per example) would attend to each other there, so the core attention it wraps
here rebuilds the per-example causal mask from the gathered position ids (`document_sdpa`).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


_swapped_attention: dict[str, Any] = {}  # transformers' attention functions as they were before Ulysses


def attach_ulysses(model: torch.nn.Module, size: int, micro_batch: int, seq_len: int, packed: bool = False) -> Any:
    """Ulysses around the model's sdpa attention (process-wide in transformers' attention table); returns the
    `mpu` DeepSpeed's engine takes."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    _swapped_attention.setdefault("sdpa", ALL_ATTENTION_FUNCTIONS["sdpa"])
    if packed:  # the core Ulysses wraps; unpacked rows need no per-example mask (and no check per layer)
        ALL_ATTENTION_FUNCTIONS["sdpa"] = document_sdpa(_swapped_attention["sdpa"])
    return UlyssesGroups(UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=size,
        micro_batch_size=micro_batch, seq_length=seq_len, seq_length_is_variable=False, disable_in_eval=True))


class UlyssesGroups:
    """Ulysses' `mpu` (DeepSpeed's `parallel_state_sp` module), answering also the question DeepSpeed asks of any
    `mpu` for the tensor-parallel size: it records that size in each checkpoint (which the universal conversion
    reads) and slices by it when it loads a universal checkpoint (`load_hp_checkpoint_state_from_checkpoint_dir`
    calls `get_tensor_model_parallel_world_size`, which `parallel_state_sp` lacks, so an SP run could not resume at
    another shape, and its checkpoints claimed the sequence size as their tensor size). No tensor parallelism: 1.
    The rank is left to the module's model-parallel rank, which DeepSpeed's gradient norm reads to count each
    replicated weight once per sequence group."""

    def __init__(self, groups: Any):
        self._groups = groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._groups, name)

    def get_tensor_model_parallel_world_size(self) -> int:
        return 1


def restore_attention() -> None:
    """Put transformers' attention functions back as they were before `attach_ulysses`."""
    if _swapped_attention:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        for name, function in _swapped_attention.items():
            ALL_ATTENTION_FUNCTIONS[name] = function
        _swapped_attention.clear()


def shard_sequence(inputs: torch.Tensor | dict, labels: torch.Tensor, size: int,
                   rank: int) -> tuple[dict, torch.Tensor]:
    """Rank `rank` of `size`'s slice of every sample's sequence: (inputs with their global positions, next-token
    targets). `inputs`: the input ids, or {"input_ids", "position_ids"} where the batch brings its own positions
    (packed examples restart them); Ulysses gathers the slices' positions back for the attention. Only the slice is
    made: no whole-sequence positions or targets on any rank."""
    input_ids = inputs["input_ids"] if isinstance(inputs, dict) else inputs
    seq = input_ids.shape[-1]
    chunk = seq // size
    start, stop = rank * chunk, (rank + 1) * chunk
    given = inputs.get("position_ids") if isinstance(inputs, dict) else None
    if given is None:
        positions = torch.arange(start, stop, device=input_ids.device).expand(*input_ids.shape[:-1], chunk)
    else:
        positions = given[..., start:stop]
    # the slice's next-token targets (`lm_targets`): labels[t + 1], with none after the sequence's last input
    targets = labels[..., start + 1:stop + 1]
    if targets.shape[-1] < chunk:
        targets = F.pad(targets, (0, chunk - targets.shape[-1]), value=-100)
    return ({"input_ids": input_ids[..., start:stop].contiguous(), "position_ids": positions.contiguous()},
            targets.contiguous())


def sequence_loss(logits: torch.Tensor, targets: torch.Tensor, size: int, group: Any, scale: torch.Tensor | None = None,
                  gradient: float = 1.0) -> torch.Tensor:
    """The group's mean next-token loss over its real tokens, as this rank's share times the group size: the ranks'
    values average to the loss one rank would compute. With `scale` (a token-weighted step,
    `bigtrain.objectives.causal_lm.token_scale`): this rank's summed loss times it. `gradient`: what of that value
    backward sees, for how DeepSpeed reduces the group's gradients (1 where it averages them with the data-parallel
    ranks, 1/size where it sums them: `ModelSplit.sequence_summed`). (A token-weighted all_reduce, not the
    tutorial's all_gather, which breaks in backward on gloo when SP < world.)"""
    summed = F.cross_entropy(logits.float().flatten(0, -2), targets.reshape(-1), ignore_index=-100, reduction="sum")
    return sequence_share(summed, targets, size, group, scale, gradient)


def sequence_share(summed: torch.Tensor, targets: torch.Tensor, size: int, group: Any,
                   scale: torch.Tensor | None = None, gradient: float = 1.0) -> torch.Tensor:
    """This rank's summed token loss as its share of the group's mean (`sequence_loss`)."""
    if scale is not None:
        value = summed * scale.to(summed.dtype)
    else:
        tokens = (targets != -100).sum().to(torch.float64).reshape(1)
        torch.distributed.all_reduce(tokens, group=group)
        value = summed / tokens[0].clamp(min=1).to(summed.dtype) * size
    if gradient == 1.0:
        return value
    return value * gradient + (value * (1.0 - gradient)).detach()  # the value reported, the gradient reduced


def document_sdpa(core: Any) -> Any:
    """sdpa that keeps attention within each packed example: given no mask and position ids that restart (what
    Ulysses passes after gathering a packed batch's positions), the causal mask of each example's own tokens, as
    transformers builds it from restarting positions without sequence parallelism (`find_packed_sequence_indices`);
    otherwise `core` unchanged (a plain causal kernel)."""

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
        positions = kwargs.get("position_ids")
        length = query.shape[-2]
        if attention_mask is None and positions is not None and length > 1 and key.shape[-2] == length:
            positions = positions.expand(query.shape[0], -1)
            starts = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1) != 1
            if bool(starts[:, 1:].any()):
                docs = starts.cumsum(-1)
                index = torch.arange(length, device=query.device)
                causal = index[:, None] >= index[None, :]
                attention_mask = (causal & (docs[:, :, None] == docs[:, None, :]))[:, None]
        return core(module, query, key, value, attention_mask, *args, **kwargs)

    return attention
