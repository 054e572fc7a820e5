"""Moving weights between a model's plain form and its pipeline form, and running the
pipeline form in one process.

A pipeline layer's local state dict is what DeepSpeed writes as
`layer_{idx:02d}-model_states.pt`. A tied layer (same `tie_key`) is one module: its state
belongs to the key's first layer and later occurrences hold none (DeepSpeed saves only the
first occurrence, whose forward is the module's own). No DeepSpeed here.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from bigtrain.models.spec import LayerDef, ModelSpec


def first_tied_layers(defs: list[LayerDef]) -> dict[str, int]:
    """tie_key -> index of its first layer (the one that owns the weights)."""
    owners: dict[str, int] = {}
    for idx, d in enumerate(defs):
        if d.tie_key is not None:
            owners.setdefault(d.tie_key, idx)
    for key, idx in owners.items():
        assert defs[idx].tie_forward is None, f"first layer of tie {key!r} must use the module's own forward"
    return owners


def _owns_state(defs: list[LayerDef], idx: int, owners: dict[str, int]) -> bool:
    d = defs[idx]
    return bool(d.param_map) and (d.tie_key is None or owners[d.tie_key] == idx)


def _to_module_name(param_map: dict[str, str], local: str) -> str:
    prefix = max((p for p in param_map if local.startswith(p)), key=len, default=None)
    assert prefix is not None, f"{local!r} is not covered by param_map {param_map}"
    return param_map[prefix] + local[len(prefix):]


LayerStates = dict[int, dict[str, torch.Tensor]]  # layer index -> that layer's local state dict


def pipeline_state_from_module(spec: ModelSpec, module_state: dict[str, torch.Tensor]) -> LayerStates:
    """Plain module state dict -> {layer index: that layer's local state dict}.

    Every module entry must land in some layer (or be an alias of a tied weight, like
    GPT-2's lm_head.weight); otherwise ValueError lists the strays (a state dict of
    another model or size).
    """
    defs = spec.layers()
    owners = first_tied_layers(defs)
    used: set[str] = set()
    out: dict[int, dict[str, torch.Tensor]] = {}
    for idx, d in enumerate(defs):
        local = {}
        for local_prefix, module_prefix in d.param_map.items():
            for key, tensor in module_state.items():
                if key.startswith(module_prefix):
                    local[local_prefix + key[len(module_prefix):]] = tensor
                    used.add(key)
        if _owns_state(defs, idx, owners):
            out[idx] = local
    strays = sorted(set(module_state) - used)
    if strays:
        raise ValueError(f"{len(strays)} entries of the {spec.family}/{spec.size} state dict map to no pipeline "
                         f"layer (another model or size?): {', '.join(strays[:5])}")
    return out


def module_state_from_pipeline(spec: ModelSpec, layer_states: LayerStates) -> dict[str, torch.Tensor]:
    """Inverse of `pipeline_state_from_module`: {layer index: local state} -> plain state dict.

    A tied weight appears under every module name its layers map to (for GPT-2 both
    transformer.wte.weight and lm_head.weight, as HF's own state dict has it). Works on
    any per-layer tensor dicts, e.g. gradients.
    """
    defs = spec.layers()
    owners = first_tied_layers(defs)
    out: dict[str, torch.Tensor] = {}
    for idx, d in enumerate(defs):
        source = owners[d.tie_key] if d.tie_key is not None else idx
        if not d.param_map or source not in layer_states:
            continue
        for local, tensor in layer_states[source].items():
            out[_to_module_name(d.param_map, local)] = tensor
    return out


def _build(d: LayerDef) -> nn.Module:
    return d.cls(*d.args, **d.kwargs)


class SequentialPipeline(nn.Module):
    """The pipeline layer list built in one process and run in sequence.

    What a DeepSpeed `PipelineModule` computes with one stage, without DeepSpeed: for
    tests, debugging and single-process tools. `layer[str(idx)]` is the module of every
    layer that owns state; tied repeats reuse their owner's module through `tie_forward`.
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.defs = spec.layers()
        owners = first_tied_layers(self.defs)
        self.layer = nn.ModuleDict()
        self.funcs: list[Callable[[Any], Any]] = []
        for idx, d in enumerate(self.defs):
            if d.tie_key is not None and owners[d.tie_key] != idx:
                owner = self.layer[str(owners[d.tie_key])]
                self.funcs.append((lambda x, f=d.tie_forward, m=owner: f(m, x)) if d.tie_forward else owner)
            else:
                self.layer[str(idx)] = _build(d)
                self.funcs.append(self.layer[str(idx)])

    def forward(self, inputs: Any) -> Any:
        x = inputs
        for func in self.funcs:
            x = func(x)
        return x

    def load_layer_states(self, layer_states: LayerStates) -> None:
        """Load {layer index: local state} (e.g. from `pipeline_state_from_module`), strictly."""
        for key, module in self.layer.items():
            module.load_state_dict(layer_states.get(int(key), {}), strict=True)

    def layer_states(self, grads: bool = False) -> LayerStates:
        """{layer index: local state dict}, or with grads=True the parameters' gradients."""
        if grads:
            return {int(k): {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
                    for k, m in self.layer.items()}
        return {int(k): m.state_dict() for k, m in self.layer.items()}
