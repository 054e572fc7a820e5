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

from bigtrain.config.rules import partition_problem
from bigtrain.models.pipeline_form import build_layer, first_tied_layers, pipeline_state_from_module
from bigtrain.models.spec import LayerDef, ModelSpec
from bigtrain.config.topology import check_topology


class _PlainStart:
    """Builds the layer with the plain model's initial weights for the run's seed (or the pretrained
    ones), whichever stage builds it: see `bigtrain.models.pipeline_form.build_layer`."""

    spec: ModelSpec
    layer: LayerDef
    owner: LayerDef
    seed: int | None = None

    def build(self, log: bool = False) -> nn.Module:
        return build_layer(self.spec, self.layer, self.owner, self.seed)


class PlainStartLayerSpec(_PlainStart, LayerSpec):
    pass


class PlainStartTiedLayerSpec(_PlainStart, TiedLayerSpec):
    pass


def layer_specs(spec: ModelSpec, defs: list[LayerDef], seed: int | None = None) -> list[LayerSpec]:
    """LayerDefs -> DeepSpeed specs, each built with the weights `spec.build(seed)` gives its tensors."""
    owners = first_tied_layers(defs)
    specs: list[LayerSpec] = []
    for d in defs:
        if d.tie_key is None:
            layer_spec = PlainStartLayerSpec(d.cls, *d.args, **d.kwargs)
        else:
            layer_spec = PlainStartTiedLayerSpec(d.tie_key, d.cls, *d.args, forward_fn=d.tie_forward,
                                                 tied_weight_attr=list(d.tied_weight_attr), **d.kwargs)
        layer_spec.spec, layer_spec.layer, layer_spec.seed = spec, d, seed
        layer_spec.owner = defs[owners[d.tie_key]] if d.tie_key is not None else d
        specs.append(layer_spec)
    return specs


def _check_partition_method(method: str) -> None:
    problem = partition_problem(method, key="partition_method")
    if problem:
        raise ValueError(problem)


def to_pipeline_module(spec: ModelSpec, num_stages: int, partition_method: str = "parameters",
                       activation_checkpoint_interval: int = 0, seed: int | None = None) -> PipelineModule:
    """Build this rank's stage of `spec` as a PipelineModule (needs an initialised process group).

    loss_fn is `spec.pipeline_loss`. With activation_checkpoint_interval > 0 only the
    layers marked `checkpointable` (the repeated blocks) are recomputed: DeepSpeed's
    default would also checkpoint the first (embedding) layer, whose integer inputs
    cannot carry gradients through a reentrant checkpoint. With `seed` every layer starts
    from the weights the plain module has for that seed (any stage count, any ZeRO stage);
    a spec with pretrained weights reads each stage's layers from the checkpoint directory.
    """
    if activation_checkpoint_interval < 0:
        raise ValueError(f"activation_checkpoint_interval={activation_checkpoint_interval}: must be >= 0")
    _check_partition_method(partition_method)
    defs = spec.layers()
    check_topology(dist.get_world_size(), num_stages, len(defs))
    checkpointable = sorted({d.cls.__name__ for d in defs if d.checkpointable})
    return PipelineModule(
        layers=layer_specs(spec, defs, seed), num_stages=num_stages, loss_fn=spec.pipeline_loss,
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


def local_layer_states(pipe: PipelineModule, spec: ModelSpec) -> dict[int, dict[str, torch.Tensor]]:
    """The inverse of `load_pipeline_state` on this stage: {layer index: its local state dict} for the
    layers this stage holds (a tied module under its first layer's index)."""
    defs = spec.layers()
    owners = first_tied_layers(defs)
    states: dict[int, dict[str, torch.Tensor]] = {}
    for idx in range(pipe._local_start, pipe._local_stop):
        d = defs[idx]
        if d.tie_key is not None:
            states[owners[d.tie_key]] = pipe.tied_modules[d.tie_key].state_dict()
        elif str(idx) in pipe._modules:
            states[idx] = pipe._modules[str(idx)].state_dict()
    return states
