"""Moving weights between a model's plain form and its pipeline form, and running the
pipeline form in one process.

A pipeline layer's local state dict is what DeepSpeed writes as
`layer_{idx:02d}-model_states.pt`. A tied layer (same `tie_key`) is one module: its state
belongs to the key's first layer and later occurrences hold none (DeepSpeed saves only the
first occurrence, whose forward is the module's own). No DeepSpeed here.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import nn

from bigtrain.models.spec import LayerDef, ModelSpec, pipeline_inputs


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


def build_layer(spec: ModelSpec, d: LayerDef, owner: LayerDef, seed: int | None) -> nn.Module:
    """One pipeline layer with the plain model's initial weights for `seed` (or the pretrained ones).

    `owner` is the layer that owns the weights (the first of a tie, else `d` itself): its
    `param_map` names the weights in the plain model, which is what the seeded init and the
    pretrained checkpoint are keyed by. Built without touching the global RNG, so the stream
    is the same whichever stage builds which layers. seed None: the constructors' own init.
    """
    from transformers.initialization import no_init_weights

    from bigtrain.models.init import init_seeded, layer_plain_name, untouched_global_rng

    fresh = spec.pretrained is not None or (seed is not None and spec.init_module is not None)
    with untouched_global_rng(), (no_init_weights() if fresh else contextlib.nullcontext()):
        module = d.cls(*d.args, **d.kwargs)
    if spec.pretrained is not None:
        load_pretrained_layer(module, owner.param_map, spec.pretrained)
    elif fresh:
        init_seeded(module, spec.init_module, seed, layer_plain_name(owner.param_map))
    return module


def load_pretrained_layer(module: nn.Module, param_map: dict[str, str], directory: str) -> None:
    """Fill one pipeline layer from a Hugging Face checkpoint directory, reading only its tensors."""
    from bigtrain.models.hf_dir import read_tensors

    own = module.state_dict()
    persistent = {name for name, _ in module.named_parameters()} | {
        f"{m}.{b}" if m else b for m, sub in module.named_modules() for b in sub._buffers
        if b not in sub._non_persistent_buffers_set}
    wanted = [n for n in own if n in persistent]
    names = {n: _to_module_name(param_map, n) for n in wanted}
    prefixes = tuple({v.split(".", 1)[0] + "." for v in names.values() if "." in v})
    tensors = read_tensors(directory, list(names.values()), strip_prefixes=prefixes)
    missing_buffers = [n for n in own if n not in persistent]
    state = {n: tensors[names[n]] for n in wanted}
    state.update({n: own[n] for n in missing_buffers})
    module.load_state_dict(state, strict=True)


class SequentialPipeline(nn.Module):
    """The pipeline layer list built in one process and run in sequence.

    What a DeepSpeed `PipelineModule` computes with one stage, without DeepSpeed: for
    tests, debugging and single-process tools. `layer[str(idx)]` is the module of every
    layer that owns state; tied repeats reuse their owner's module through `tie_forward`.
    With `seed` the layers start from the weights `spec.build(seed)` has (or the pretrained ones).
    """

    def __init__(self, spec: ModelSpec, seed: int | None = None) -> None:
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
                owner = self.defs[owners[d.tie_key]] if d.tie_key is not None else d
                self.layer[str(idx)] = build_layer(spec, d, owner, seed)
                self.funcs.append(self.layer[str(idx)])

    def forward(self, inputs: Any) -> Any:
        x = pipeline_inputs(inputs)
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
