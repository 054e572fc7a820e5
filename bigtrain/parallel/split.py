"""Splitting a plain module beyond ZeRO, from the outside: tensor parallelism (DeepSpeed AutoTP) and sequence
parallelism (DeepSpeed Ulysses / ALST). The model family knows nothing of either.

- Tensor: DeepSpeed's engine shards the layers itself (`"tensor_parallel": {"autotp_size": N}`); bigtrain makes
  its process groups first and hands them to `deepspeed.initialize` (and to `zero.Init`) as the `mpu`, so that
  DeepSpeed counts the data-parallel ranks, not every rank, in the batch triple. The ranks of a group see the
  same batch (DeepSpeed checks the first one).
- Sequence: Ulysses swaps the sdpa attention for an all-to-all around it; every rank of a group takes its slice
  of each sample's sequence (with the positions of that slice), and the loss is summed over the group's tokens
  here, weighted by the real (not ignored) tokens each rank holds. Ulysses drops the model's attention mask (it
  was made for the local slice) and runs plain causal sdpa over the gathered sequence; packed examples
  (position ids restarting per example) would attend to each other there, so the core attention it wraps here
  rebuilds the per-example causal mask from the gathered position ids (`document_sdpa`).

Ranks are laid out data-major: a group is `size` consecutive ranks, as DeepSpeed builds both.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from bigtrain.models.losses import lm_targets
from bigtrain.models.spec import ModelSpec


@dataclass(frozen=True)
class Topology:
    """world = pipeline x tensor x sequence x data, as torchtitan's ParallelDims (experts would spread over
    the data ranks)."""

    world: int
    pipeline: int = 1
    tensor: int = 1
    sequence: int = 1

    @property
    def data(self) -> int:
        return self.world // (self.pipeline * self.tensor * self.sequence)

    @property
    def model_split(self) -> int:
        """Ranks that share one batch (a tensor or sequence group)."""
        return self.tensor * self.sequence

    @classmethod
    def of(cls, ds_config: dict, world: int) -> "Topology":
        """The split a resolved DeepSpeed dict asks for."""
        from bigtrain.ds.keys import split_sizes
        tensor, sequence, _ = split_sizes(ds_config)
        pipeline = (ds_config.get("pipeline") or {}).get("stages") or 1
        return cls(world, pipeline, tensor, sequence)


class ModelSplit:
    """What the engine needs for a split model: the `mpu` for DeepSpeed, the data-parallel coordinates, and for
    sequence parallelism the batch slice and the loss."""

    def __init__(self, topology: Topology, rank: int, mpu: Any = None):
        self.topology, self.rank, self.mpu = topology, rank, mpu

    @classmethod
    def for_job(cls, spec: ModelSpec, topology: Topology, rank: int) -> "ModelSplit":
        """Check the model can be split so, and make the tensor-parallel groups (before the model is built:
        zero.Init needs them). Sequence parallelism is switched on by `attach`, once the model exists."""
        check_split(spec, topology)
        if rank == 0 and (line := kv_heads_line(spec, topology)):
            logging.getLogger(__name__).warning("%s", line)
        reset_groups()  # an earlier job's groups in this process would be taken for this one's
        if topology.tensor == 1:
            return cls(topology, rank)
        from deepspeed.utils import groups
        groups._init_tp_mesh_device(tensor_model_parallel_size=topology.tensor)
        return cls(topology, rank, groups)

    def attach(self, model: torch.nn.Module, spec: ModelSpec, micro_batch: int, packed: bool = False) -> None:
        """Ulysses around the model's sdpa attention (process-wide in transformers' attention table)."""
        if self.topology.sequence == 1:
            return
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        _swapped_attention.setdefault("sdpa", ALL_ATTENTION_FUNCTIONS["sdpa"])
        if packed:  # the core Ulysses wraps; unpacked rows need no per-example mask (and no check per layer)
            ALL_ATTENTION_FUNCTIONS["sdpa"] = document_sdpa(_swapped_attention["sdpa"])
        self.mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=self.topology.sequence,
            micro_batch_size=micro_batch, seq_length=spec.seq_len, seq_length_is_variable=False, disable_in_eval=True)

    @property
    def data_rank(self) -> int:
        return self.rank // self.topology.model_split

    @property
    def data_size(self) -> int:
        return self.topology.data

    @property
    def sequence_parallel(self) -> bool:
        return self.topology.sequence > 1

    def shard(self, inputs: torch.Tensor | dict, labels: torch.Tensor) -> tuple[dict, torch.Tensor]:
        """This rank's slice of every sample's sequence: (inputs with their global positions, next-token targets).
        `inputs`: the input ids, or {"input_ids", "position_ids"} where the batch brings its own positions (packed
        examples restart them); Ulysses gathers the slices' positions back for the attention."""
        input_ids = inputs["input_ids"] if isinstance(inputs, dict) else inputs
        size, seq = self.topology.sequence, input_ids.shape[-1]
        chunk = seq // size
        part = slice(self.mpu.get_sequence_parallel_rank() * chunk, (self.mpu.get_sequence_parallel_rank() + 1) * chunk)
        given = inputs.get("position_ids") if isinstance(inputs, dict) else None
        positions = torch.arange(seq, device=input_ids.device).expand_as(input_ids) if given is None else given
        targets = lm_targets(labels, seq)
        return ({"input_ids": input_ids[:, part].contiguous(), "position_ids": positions[:, part].contiguous()},
                targets[:, part].contiguous())

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """The group's mean next-token loss over its real tokens, as this rank's share times the group size:
        DeepSpeed averages gradients over every rank, so the shares sum to the loss one rank would compute.
        With `scale` (a token-weighted step, `bigtrain.objectives.causal_lm.token_scale`): this rank's summed loss times it."""
        summed = F.cross_entropy(logits.float().flatten(0, -2), targets.reshape(-1), ignore_index=-100,
                                 reduction="sum")
        if scale is not None:
            return summed * scale.to(summed.dtype)
        tokens = (targets != -100).sum().to(torch.float64).reshape(1)
        torch.distributed.all_reduce(tokens, group=self.mpu.get_sequence_parallel_group())
        return summed / tokens[0].clamp(min=1).to(summed.dtype) * self.topology.sequence


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


def check_split_layout(run: Any, topology: Topology) -> None:
    """ValueError (one line) when the sizes the resolved DeepSpeed dict asks for break a rule of the run config or
    a mode the family does not have: a size from the user's JSON (tensor_parallel.autotp_size, ...) is judged
    like the same size given with --set, before any data or model is built."""
    from dataclasses import replace
    replace(run, pipeline=replace(run.pipeline, stages=topology.pipeline),  # re-runs the run config's own rules
            parallel=replace(run.parallel, tensor=topology.tensor, sequence=topology.sequence))
    check_family_modes(run.model.family, topology)


def check_family_modes(family_name: str, topology: Topology) -> None:
    """ValueError (one line) for a split the family has no mode for."""
    from bigtrain.models.registry import family
    modes = family(family_name).parallel
    for mode, size in (("tensor", topology.tensor), ("sequence", topology.sequence)):
        if size > 1 and mode not in modes:
            raise ValueError(f"parallel.{mode}={size}: the {family_name} family does not support {mode} "
                             f"parallelism (it supports {', '.join(sorted(modes))}); {_why_not(family_name, mode)}")


def kv_heads_line(spec: ModelSpec, topology: Topology) -> str | None:
    """DeepSpeed's AutoTP warns in the rank's log only when a tensor group outnumbers the key-value heads."""
    config = getattr(spec.config, "get_text_config", lambda: spec.config)()
    kv_heads = getattr(config, "num_key_value_heads", None)
    if kv_heads is None or topology.tensor <= kv_heads:
        return None
    return (f"parallel.tensor={topology.tensor} with the model's {kv_heads} key-value heads: DeepSpeed's AutoTP "
            f"gives the ranks beyond {kv_heads} no attention shard of their own, so attention does not get faster "
            f"past parallel.tensor={kv_heads} (training is correct either way)")


def check_split(spec: ModelSpec, topology: Topology) -> None:
    """ValueError (one line) for a model that cannot be split as asked: the family, the heads, the attention."""
    check_family_modes(spec.family, topology)
    config = getattr(spec.config, "get_text_config", lambda: spec.config)()
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", heads)
    for mode, size in (("tensor", topology.tensor), ("sequence", topology.sequence)):
        if size > 1 and heads is not None and heads % size:
            raise ValueError(f"parallel.{mode}={size}: the model's {heads} attention heads do not divide by {size}; "
                             f"choose parallel.{mode} dividing {heads}")
    if topology.sequence > 1:
        if kv_heads is not None and kv_heads % topology.sequence and topology.sequence % kv_heads:
            raise ValueError(f"parallel.sequence={topology.sequence}: the model's {kv_heads} key-value heads neither "
                             f"divide by it nor divide it (Ulysses splits or repeats them); choose another size")
        attention = getattr(config, "_attn_implementation", None)
        if attention not in (None, "sdpa"):
            raise ValueError(f"parallel.sequence={topology.sequence}: Ulysses wraps sdpa attention, and this model "
                             f"uses {attention}; set model.overrides.attn_implementation=sdpa (or parallel.sequence=1)")


def _why_not(family_name: str, mode: str) -> str:
    if mode == "tensor":
        return "DeepSpeed's AutoTP has no sharding plan for it; use ZeRO-3 (states) or a Llama-family model"
    return "Ulysses needs a decoder with sdpa attention; use a Llama-family model or a Hugging Face decoder"


_swapped_attention: dict[str, Any] = {}  # transformers' attention functions as they were before Ulysses


def reset_groups() -> None:
    """Forget the process groups and the Ulysses attention of an earlier job in this process (test harnesses run
    several): DeepSpeed keeps them in module globals, and would reuse groups of another size."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.utils import groups
    if _swapped_attention:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        for name, function in _swapped_attention.items():
            ALL_ATTENTION_FUNCTIONS[name] = function
        _swapped_attention.clear()
    parallel_state_sp._release_sequence_parallel_groups()
    for name in ("_TENSOR_MODEL_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP",
                 "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE", "_MPU_TENSOR_MODEL_PARALLEL_RANK", "mpu", "mesh_device"):
        setattr(groups, name, None)
