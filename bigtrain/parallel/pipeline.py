"""A model spec's layer list as a DeepSpeed `PipelineModule`.

The only place LayerDefs become `LayerSpec` / `TiedLayerSpec`. Tied layers (GPT-2's token
embedding and output head) become one module per stage that holds them; DeepSpeed
all-reduces their gradients across those stages, so the weights stay equal.
"""
from __future__ import annotations

import torch
from deepspeed import comm as dist
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

from bigtrain.models.pipeline_form import first_tied_layers, pipeline_state_from_module
from bigtrain.models.spec import LayerDef, ModelSpec
from bigtrain.parallel.topology import check_topology


class _Seeded:
    """Builds the layer under its own seed, so its initial weights do not depend on which
    stage builds it (the same model at 1, 2 or 4 stages) nor touch the global RNG stream."""

    seed: int | None = None

    def build(self, log: bool = False) -> nn.Module:
        if self.seed is None:
            return super().build(log)  # type: ignore[misc]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            return super().build(log)  # type: ignore[misc]


class SeededLayerSpec(_Seeded, LayerSpec):
    pass


class SeededTiedLayerSpec(_Seeded, TiedLayerSpec):
    pass


def layer_specs(defs: list[LayerDef], seed: int | None = None) -> list[LayerSpec]:
    """LayerDefs -> DeepSpeed specs; layer i is built under seed + i when a seed is given."""
    specs: list[LayerSpec] = []
    for idx, d in enumerate(defs):
        if d.tie_key is None:
            spec = SeededLayerSpec(d.cls, *d.args, **d.kwargs)
        else:
            spec = SeededTiedLayerSpec(d.tie_key, d.cls, *d.args, forward_fn=d.tie_forward,
                                       tied_weight_attr=list(d.tied_weight_attr), **d.kwargs)
        spec.seed = None if seed is None else seed + idx
        specs.append(spec)
    return specs


def _check_partition_method(method: str) -> None:
    if method not in ("parameters", "uniform") and not method.startswith("type:"):
        raise ValueError(f"partition_method={method!r}: use 'parameters', 'uniform' or 'type:REGEX'")


def to_pipeline_module(spec: ModelSpec, num_stages: int, partition_method: str = "parameters",
                       activation_checkpoint_interval: int = 0, seed: int | None = None) -> PipelineModule:
    """Build this rank's stage of `spec` as a PipelineModule (needs an initialised process group).

    loss_fn is `spec.pipeline_loss`. With activation_checkpoint_interval > 0 only the
    layers marked `checkpointable` (the repeated blocks) are recomputed: DeepSpeed's
    default would also checkpoint the first (embedding) layer, whose integer inputs
    cannot carry gradients through a reentrant checkpoint. `seed` makes each layer's
    initial weights independent of the partitioning.
    """
    if activation_checkpoint_interval < 0:
        raise ValueError(f"activation_checkpoint_interval={activation_checkpoint_interval}: must be >= 0")
    _check_partition_method(partition_method)
    defs = spec.layers()
    check_topology(dist.get_world_size(), num_stages, len(defs))
    checkpointable = sorted({d.cls.__name__ for d in defs if d.checkpointable})
    return PipelineModule(
        layers=layer_specs(defs, seed), num_stages=num_stages, loss_fn=spec.pipeline_loss,
        partition_method=partition_method, activation_checkpoint_interval=activation_checkpoint_interval,
        checkpointable_layers=checkpointable)


def load_pipeline_state(pipe: PipelineModule, spec: ModelSpec, module_state: dict[str, torch.Tensor]) -> None:
    """Load a plain module's state dict into the layers this stage holds (tied ones included).

    For comparing a pipeline with the plain module from the same weights, or starting a
    pipeline run from a plain (e.g. HF) checkpoint.
    """
    defs = spec.layers()
    owners = first_tied_layers(defs)
    states = pipeline_state_from_module(spec, module_state)
    for idx in range(pipe._local_start, pipe._local_stop):
        d = defs[idx]
        if d.tie_key is not None:
            pipe.tied_modules[d.tie_key].load_state_dict(states[owners[d.tie_key]], strict=True)
        elif str(idx) in pipe._modules:
            pipe._modules[str(idx)].load_state_dict(states.get(idx, {}), strict=True)
