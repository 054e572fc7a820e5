"""A model's shape as the memory model reads it: parameters counted on the meta device (no memory, no weights;
a pretrained directory is read for its config only), the parts tensor parallelism keeps whole, and the activations
where a family has no closed form (counted by `bigtrain.estimate.counting`; `bigtrain.estimate.memory_model` reads
the shape).
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from bigtrain.estimate.activations import measured_key
from bigtrain.estimate.counting import count_activations, meta_module, mlp_count, tiled_mlp_saving
from bigtrain.estimate.memory_model import PRECISIONS, ModelShape

if TYPE_CHECKING:  # torch is imported where it is used: `bigtrain estimate --help` starts without it
    import torch

    from bigtrain.models.spec import ModelSpec


def parameter_layout(module: torch.nn.Module) -> tuple[int, tuple[int, ...], int]:
    """(unique parameters, each tensor's size, the largest module's own parameters)."""
    numels = tuple(p.numel() for p in module.parameters())  # parameters() already skips tied duplicates
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules()), default=0)
    return sum(numels), numels, largest


def linear_dims(module: torch.nn.Module) -> tuple[tuple[int, int], ...]:
    """(in, out) of every linear layer but the output head: what LoRA's default targets (all-linear) adapt."""
    from torch import nn
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    dims = []
    for m in module.modules():
        if m is head:
            continue
        if isinstance(m, nn.Linear):
            dims.append((m.in_features, m.out_features))
        elif type(m).__name__ == "Conv1D":  # GPT-2's linear layers, weight stored (in, out)
            dims.append(tuple(m.weight.shape))
    return tuple(dims)


def tensor_whole_params(module: torch.nn.Module) -> int:
    """Parameters AutoTP leaves whole on every rank of a tensor-parallel group: all but the linear layers'
    (embeddings, norms; a head tied to the embedding counts as the embedding). Measured: a 4-layer Llama's
    model states at parallel.tensor 2 and 4 are the split linear layers' share plus exactly these
    (docs/benchmarks.md)."""
    from torch import nn
    seen: set[int] = set()
    whole = 0
    for m in module.modules():
        for p in m.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                whole += 0 if isinstance(m, nn.Linear) else p.numel()
    return whole


def expert_params(module: torch.nn.Module) -> int:
    """Parameters of a mixture of experts' experts (transformers names them `...experts...`): what expert
    parallelism spreads over its ranks."""
    return sum(p.numel() for name, p in module.named_parameters() if ".experts." in f".{name}")


def muon_params(module: torch.nn.Module) -> int:
    """Parameters DeepSpeed's Muon trains (the rest go to its Adam half): tagged by DeepSpeed's own rule
    (`deepspeed.set_optimizer_flags`: matrices outside the embeddings and the head), on the meta module."""
    from types import SimpleNamespace

    from deepspeed import set_optimizer_flags
    from deepspeed.runtime.config import MUON_OPTIMIZER
    set_optimizer_flags(SimpleNamespace(optimizer_name=MUON_OPTIMIZER, optimizer_params={}), module)
    return sum(p.numel() for p in module.parameters() if getattr(p, "use_muon", False))


def shape_from_spec(spec: ModelSpec, precision: str | None = None, meta: torch.nn.Module | None = None, *,
                    tiled: bool | None = None, chunked: bool | None = None) -> ModelShape:
    """The memory model's view of `spec`; activations are measured for `precision` (default both sizes of value)
    and, for families without a closed form, with and without the tiled MLP and the chunked loss where the model
    allows them (`tiled` / `chunked`: only as given). `meta`: the module on the meta device, when the caller has
    built it (`meta_module`)."""
    from bigtrain.models.registry import estimate_shape
    meta = meta_module(spec) if meta is None else meta
    numel, numels, largest = parameter_layout(meta)
    assert numel == spec.num_params, f"{spec.family} {spec.size}: counted {numel} parameters, spec {spec.num_params}"
    common = dict(family=spec.family, num_params=numel, param_numels=numels, largest_layer_params=largest,
                  linear_dims=linear_dims(meta), tensor_whole_params=tensor_whole_params(meta),
                  expert_params=expert_params(meta), muon_params=muon_params(meta), mlp_layers=mlp_count(spec),
                  context=spec.seq_len or 0, kv_per_token=kv_per_token(spec.config))
    import torch
    dtypes = {4: torch.float32, 2: torch.bfloat16}
    sizes = [PRECISIONS[precision]] if precision else sorted(set(PRECISIONS.values()))
    analytic = estimate_shape(spec)  # the family's closed form, where it has one
    if analytic is not None:
        savings = {e: tiled_mlp_saving(spec, dtypes[e])[0] for e in sizes} if common["mlp_layers"] else {}
        return ModelShape(**common, **analytic, tiled_mlp_saving=savings)
    from bigtrain.train.fast_path import chunked_unsupported
    tilings = [tiled] if tiled is not None else [False, True][:1 + bool(common["mlp_layers"])]
    losses = [chunked] if chunked is not None else [False, True][:1 + (chunked_unsupported(spec, meta) is None)]
    measured = {measured_key(e, t, c): count_activations(spec, dtypes[e], spec.hidden_size if t else 0, c)
                for e in sizes for t in tilings for c in losses}
    if spec.modality == "vision":  # the language model's tokens above, and one image through the tower a sample
        from bigtrain.estimate.vision import image_side
        saved = {e: image_side(spec, dtypes[e]).saved_bytes for e in sizes}
        measured = {key: replace(count, outside=count.outside + saved[key[0]]) for key, count in measured.items()}
    return ModelShape(**common, measured=measured)


def kv_per_token(config: Any) -> int:
    """Values a decoder's KV cache keeps per token of a row, from its transformers config: layers x (key + value) x
    kv_heads x head_dim (grouped-query attention's kv_heads; head_dim where the config sets it, else hidden / heads).
    0 for a config without attention layers (a convolutional net)."""
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    if not layers or not heads:
        return 0
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return int(layers * 2 * kv_heads * head_dim)


def frozen_params(objective: Any, seq_len: int | None) -> int:
    """The parameters of the frozen models the run's objective holds beside the policy (`Needs.frozen_models`: a
    reward model, a teacher; `objective` is the run config's section), counted on the meta device from their
    directories' configs."""
    from bigtrain.models.registry import build_directory
    total = 0
    for frozen in objective.declared.frozen_models:
        directory = frozen.directory(objective.settings)
        if directory is not None:
            spec = build_directory(directory, seq_len, frozen.head, f"objective.{frozen.setting}")
            total += parameter_layout(meta_module(spec))[0]
    return total
