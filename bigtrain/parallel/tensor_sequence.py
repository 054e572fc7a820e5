"""Tensor x sequence parallelism: DeepSpeed's AutoTP shards each layer over a tensor group, and Ulysses splits the
sequence over the ranks that hold the same shards, all-to-all within that shard's heads (Megatron's and torchtitan's
TP x CP for long contexts on large models).

Layout, rank = (data x sequence + s) x tensor + t: a tensor group is `tensor` consecutive ranks (DeepSpeed's mesh
builds them so), its ranks read the same slice of a sample; a sequence group is the `sequence` ranks with the same
tensor rank inside one data replica, each with its slice. DeepSpeed's engine, once AutoTP is on, takes its own
`groups` module as its `mpu` (engine._configure_tensor_parallel_states), so it sees no sequence parallelism: it
averages gradients and partitions ZeRO's states over the ranks of its mesh's data-parallel group, every rank with
the same tensor rank, the sequence ranks among them. That is what Ulysses asks of it (each rank's loss is its
share of the group's mean times the sequence size, `bigtrain.parallel.sequence.sequence_share`). The `mpu` handed to
`deepspeed.initialize` (and zero.Init) only gives the batch triple its data-parallel size; `SequenceGroups` keeps the
groups bigtrain's sequence parallelism reads.

Ulysses' own registration (`UlyssesSPAttentionHF.register_with_transformers`) builds its groups of consecutive ranks,
which are the tensor groups here, and counts the model's heads before AutoTP splits them: `attach_tensor_sequence`
builds DeepSpeed's `UlyssesSPAttentionHF` itself, over the heads one tensor rank holds.
"""
from __future__ import annotations

from typing import Any

import torch
from deepspeed import comm as dist


class SequenceGroups:
    """The `mpu` of a tensor x sequence job (Megatron's names, as DeepSpeed reads them): its tensor groups are
    DeepSpeed's (`deepspeed.utils.groups`, made first), the sequence and data groups bigtrain's."""

    def __init__(self, tensor: int, sequence: int):
        from deepspeed.utils import groups
        self.groups, self.tensor, self.sequence = groups, tensor, sequence
        world, rank = dist.get_world_size(), dist.get_rank()
        data = world // (tensor * sequence)
        self._sequence = self._data = None
        for d in range(data):  # every rank makes every group, in the same order (torch.distributed's rule)
            for t in range(tensor):
                ranks = [(d * sequence + s) * tensor + t for s in range(sequence)]
                group = dist.new_group(ranks)
                if rank in ranks:
                    self._sequence = group
        for s in range(sequence):
            for t in range(tensor):
                ranks = [(d * sequence + s) * tensor + t for d in range(data)]
                group = dist.new_group(ranks)
                if rank in ranks:
                    self._data = group

    # -- what bigtrain's sequence parallelism reads ---------------------------------------------------------
    def get_sequence_parallel_group(self) -> Any:
        return self._sequence

    def get_sequence_parallel_rank(self) -> int:
        return dist.get_rank(group=self._sequence)

    def get_sequence_parallel_world_size(self) -> int:
        return self.sequence

    # -- what DeepSpeed's config reads for the batch triple (its engine then takes `groups` for the rest) ----
    def get_data_parallel_group(self) -> Any:
        return self._data

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(group=self._data)

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(group=self._data)

    def get_tensor_model_parallel_group(self) -> Any:
        return self.groups.get_tensor_model_parallel_group()

    def get_tensor_model_parallel_rank(self) -> int:
        return self.groups.get_tensor_model_parallel_rank()

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tensor

    get_model_parallel_group = get_tensor_model_parallel_group
    get_model_parallel_rank = get_tensor_model_parallel_rank
    get_model_parallel_world_size = get_tensor_model_parallel_world_size


def attach_tensor_sequence(model: torch.nn.Module, mpu: SequenceGroups, micro_batch: int, seq_len: int,
                           packed: bool = False) -> None:
    """Ulysses around the model's sdpa attention over the heads of one tensor rank (process-wide in transformers'
    attention table, as `bigtrain.parallel.sequence.attach_ulysses`, packed rows kept apart the same way), all-to-all
    within `mpu`'s sequence group."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from bigtrain.parallel.sequence import _swapped_attention, document_sdpa
    config = model.config.get_text_config()
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    _swapped_attention.setdefault("sdpa", ALL_ATTENTION_FUNCTIONS["sdpa"])
    ulysses = UlyssesSPAttentionHF(
        attn=document_sdpa(_swapped_attention["sdpa"]) if packed else _swapped_attention["sdpa"], batch_size=micro_batch, attn_head_count=heads // mpu.tensor,
        attn_head_size=getattr(config, "head_dim", None) or config.hidden_size // heads,
        kv_head_count=max(1, kv_heads // mpu.tensor), num_hidden_layers=config.num_hidden_layers,
        process_group=mpu.get_sequence_parallel_group(), seq_length_is_variable=False,
        local_seq_length=seq_len // mpu.sequence, global_seq_length=seq_len, disable_in_eval=True)
    ulysses.core_attn_implementation = "sdpa"

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        # as DeepSpeed's wrapper: the mask transformers made for the local slice is wrong for the gathered sequence
        return ulysses(module, query, key, value, None, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = attention
