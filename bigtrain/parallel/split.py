"""What the engine needs to train a plain module split beyond ZeRO: the process groups and the `mpu` DeepSpeed
takes, this rank's data-parallel coordinates, and for sequence parallelism the batch slice and the loss. The model
family knows nothing of either; the sizes are the job's `Topology`.

- Tensor: DeepSpeed's engine shards the layers itself (`"tensor_parallel": {"autotp_size": N}`); bigtrain makes
  its process groups first and hands them to `deepspeed.initialize` (and to `zero.Init`) as the `mpu`, so that
  DeepSpeed counts the data-parallel ranks, not every rank, in the batch triple. The ranks of a group see the
  same batch (DeepSpeed checks the first one).
- Sequence: Ulysses (`bigtrain.parallel.sequence`); with tensor parallelism, within each tensor shard's heads
  (`bigtrain.parallel.tensor_sequence`).

Ranks are laid out data-major: a group is `size` consecutive ranks, as DeepSpeed builds both.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from bigtrain.models.spec import ModelSpec
from bigtrain.parallel.sequence import attach_ulysses, restore_attention, sequence_loss, sequence_share, shard_sequence
from bigtrain.parallel.split_rules import check_split, kv_heads_line
from bigtrain.config.topology import Topology


class ModelSplit:
    """The engine's view of its split: `topology`, this rank, and the `mpu` handed to DeepSpeed (None: DeepSpeed
    makes its own groups)."""

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
        if topology.sequence > 1:  # Ulysses within each tensor shard's heads (bigtrain.parallel.tensor_sequence)
            from bigtrain.parallel.tensor_sequence import SequenceGroups
            return cls(topology, rank, SequenceGroups(topology.tensor, topology.sequence))
        return cls(topology, rank, groups)

    def attach(self, model: torch.nn.Module, spec: ModelSpec, micro_batch: int, packed: bool = False) -> None:
        """Ulysses around the model's sdpa attention, where the topology splits sequences."""
        if self.topology.sequence > 1 and self.topology.tensor > 1:
            from bigtrain.parallel.tensor_sequence import attach_tensor_sequence
            attach_tensor_sequence(model, self.mpu, micro_batch, spec.seq_len, packed)
        elif self.topology.sequence > 1:
            self.mpu = attach_ulysses(model, self.topology.sequence, micro_batch, spec.seq_len, packed)

    @property
    def data_rank(self) -> int:
        return self.rank // self.topology.model_split

    @property
    def data_size(self) -> int:
        return self.topology.data

    @property
    def sequence_parallel(self) -> bool:
        return self.topology.sequence > 1

    @property
    def sequence_summed(self) -> bool:
        """Whether DeepSpeed's engine sums the gradients of a sequence group's ranks (Ulysses alone: it knows the
        group from the `mpu`, and averages over the data-parallel ranks only), rather than averaging them with the
        data-parallel ranks (with AutoTP, whose engine takes its own groups and sees the sequence ranks as data
        ranks). Each rank's loss share is scaled to match (`share`, `token_scale`); `assemble` checks the engine
        agrees."""
        return self.topology.sequence > 1 and self.topology.tensor == 1

    def shard(self, inputs: torch.Tensor | dict, labels: torch.Tensor) -> tuple[dict, torch.Tensor]:
        """This rank's slice of every sample's sequence (`bigtrain.parallel.sequence.shard_sequence`)."""
        return shard_sequence(inputs, labels, self.topology.sequence, self.mpu.get_sequence_parallel_rank())

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """The sequence group's loss share (`bigtrain.parallel.sequence.sequence_loss`)."""
        return sequence_loss(logits, targets, self.topology.sequence, self.mpu.get_sequence_parallel_group(), scale,
                             self._gradient)

    def share(self, summed: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's summed token loss (the chunked loss's) as its share of the group's loss."""
        return sequence_share(summed, targets, self.topology.sequence, self.mpu.get_sequence_parallel_group(), scale,
                              self._gradient)

    @property
    def _gradient(self) -> float:
        return 1.0 / self.topology.sequence if self.sequence_summed else 1.0


def reset_groups() -> None:
    """Forget the process groups and the Ulysses attention of an earlier job in this process (test harnesses run
    several): DeepSpeed keeps them in module globals, and would reuse groups of another size."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.utils import groups
    restore_attention()
    parallel_state_sp._release_sequence_parallel_groups()
    for name in ("_TENSOR_MODEL_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP",
                 "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE", "_MPU_TENSOR_MODEL_PARALLEL_RANK", "mpu", "mesh_device",
                 "_ZERO_PARAM_INTRA_PARALLEL_GROUP"):
        setattr(groups, name, None)
