"""A model's shape as the memory model reads it: parameters counted on the meta device (no memory, no weights;
a pretrained directory is read for its config only), the parts tensor parallelism keeps whole, and the activations
a forward saves for backward where a family has no closed form (`bigtrain.estimate.memory_model`).
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from bigtrain.estimate.memory_model import PRECISIONS, ActivationCount, ModelShape

if TYPE_CHECKING:  # torch is imported where it is used: `bigtrain estimate --help` starts without it
    from collections.abc import Iterator

    import torch

    from bigtrain.models.spec import ModelSpec


def meta_module(spec: ModelSpec) -> torch.nn.Module:
    """The module on the meta device. A pretrained model's `construct` loads weights, which the meta
    device cannot hold: its shape is built from the config instead (nothing is read but config.json)."""
    import torch
    construct = getattr(spec, "construct", None) or spec.build
    if spec.pretrained or spec.source_dir:
        hf_class = getattr(spec, "hf_class", None) or type(None)
        if hasattr(hf_class, "_from_config"):
            with torch.device("meta"):
                return hf_class._from_config(spec.config)
    with torch.device("meta"):
        return construct()


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


def _sample_batch(spec: ModelSpec, device: str) -> dict:
    import torch
    with torch.device(device):
        if spec.modality == "image":
            size = spec.image_size
            return {"pixel_values": torch.zeros(1, 3, size, size), "labels": torch.zeros(1, dtype=torch.long)}
        ids = torch.zeros(1, spec.seq_len, dtype=torch.long)
        if spec.modality == "text":
            return {"input_ids": ids, "labels": ids}
        batch = {"input_ids": ids, "labels": torch.zeros(1, dtype=torch.long)}
        if getattr(spec, "hf_class", None) is not None:
            # As in training, where classifier batches carry a mask: without one some HF classes (DeBERTa-v2)
            # probe the ids for padding with a data-dependent branch, which a meta tensor cannot answer.
            batch["attention_mask"] = torch.ones_like(ids)
        return batch


@contextlib.contextmanager
def _no_packed_sequence_probe(device: str) -> Iterator[None]:
    """transformers' decoders look for packed sequences in the position ids with a data-dependent `.all()`,
    which a meta tensor cannot answer; one unpacked sequence per sample is what is measured anyway."""
    if device != "meta":
        yield
        return
    from unittest import mock
    try:
        import transformers.masking_utils as masking
    except ImportError:
        yield
        return
    with mock.patch.object(masking, "find_packed_sequence_indices", lambda position_ids: None):
        yield


@contextlib.contextmanager
def _plain_grouped_mm(device: str) -> Iterator[None]:
    """transformers' mixtures of experts call torch's grouped matmul, whose meta kernel takes bf16 only (fp32 runs on
    a CPU through transformers' own fallback): on the meta device the fallback, which saves the same tensors."""
    if device != "meta":
        yield
        return
    from unittest import mock
    try:
        import transformers.integrations.moe as moe
    except ImportError:
        yield
        return
    with mock.patch.object(moe, "_can_use_grouped_mm", lambda *args, **kwargs: False):
        yield


@contextlib.contextmanager
def _fused_sdpa() -> Iterator[None]:
    """On the meta device torch's sdpa runs its math kernel, which saves the [s, s] attention probabilities; the
    fused kernels training runs (flash and memory-efficient on GPUs, flash on CPUs) save the inputs, the output
    and one fp32 log-sum-exp per query. Measured inside this, sdpa saves what they save."""
    from unittest import mock

    import torch

    class FusedAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = q.new_empty(*q.shape[:-1], v.shape[-1])
            ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
            return out

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple:
            q, k, v, _, _ = ctx.saved_tensors
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return FusedAttention.apply(query, key, value)  # grouped key-value heads stay grouped (enable_gqa)

    with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", sdpa):
        yield


def tiled_mlp_saving(spec: ModelSpec, dtype: torch.dtype) -> tuple[float, int]:
    """(bytes per sample one MLP no longer keeps for backward under ALST's tiled MLP, how many MLPs): the blocks'
    saved tensors counted on the meta device with and without DeepSpeed's TiledMLP (bigtrain.parallel.tiling)."""
    hidden = spec.hidden_size
    if spec.modality != "text" or not spec.seq_len or not hidden:
        return 0.0, 0
    from bigtrain.parallel.tiling import mlp_modules
    count = len(mlp_modules(meta_module(spec)))
    if not count:  # nothing to tile (a mixture of experts' blocks are not MLPs here)
        return 0.0, 0
    plain = measure_activations(spec, dtype)
    tiled = measure_activations(spec, dtype, tile=hidden)
    return max(0.0, plain.blocks - tiled.blocks) / count, count


def measure_activations(spec: ModelSpec, dtype: torch.dtype, device: str = "meta",
                        tile: int = 0) -> ActivationCount:
    """Bytes saved for backward by one sample, counted from the saved tensors of a forward on `device`.

    Parameters are not activations and are left out; every storage counts once. Blocks are
    `spec.checkpoint_blocks`; a block's input is what checkpointing keeps of it. On the meta device sdpa saves
    what training's fused kernels save (`_fused_sdpa`); an eager attention saves its probabilities either way.
    """
    import torch
    if device == "meta":
        module = meta_module(spec)
    else:
        module = spec.build()
    module = module.to(dtype).train()
    if tile:  # ALST's tiled MLP, as the engine applies it
        from bigtrain.parallel.tiling import apply_tiled_mlp
        apply_tiled_mlp(module, tile)
    places = spec.checkpoint_blocks(module) if spec.checkpoint_blocks else []
    blocks = [getattr(parent, name) for parent, name in places]
    param_keys = {p.untyped_storage()._cdata for p in module.parameters()}
    saved: dict[int, tuple[int, int]] = {}  # storage -> (bytes, block index or -1)
    where = [-1]
    block_inputs = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key not in param_keys and key not in saved:
            saved[key] = (t.untyped_storage().nbytes(), where[-1])
        return t

    def enter(i: int, args: tuple) -> None:
        where.append(i)
        block_inputs.append(args[0].untyped_storage().nbytes())

    def leave(*_: Any) -> None:
        where.pop()

    hooks = []
    for i, block in enumerate(blocks):
        hooks.append(block.register_forward_pre_hook(lambda m, args, i=i: enter(i, args)))
        hooks.append(block.register_forward_hook(leave))
    batch = _sample_batch(spec, device)
    if spec.modality == "image":
        batch["pixel_values"] = batch["pixel_values"].to(dtype)
    inputs, labels = spec.batch_to_inputs(batch)
    fused = _fused_sdpa() if device == "meta" else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _no_packed_sequence_probe(device), fused, \
            _plain_grouped_mm(device):
        spec.loss(module(**inputs) if isinstance(inputs, dict) else module(inputs), labels)
    for h in hooks:
        h.remove()
    per_block = [sum(b for b, w in saved.values() if w == i) for i in range(len(blocks))]
    outside = sum(b for b, w in saved.values() if w == -1)
    return ActivationCount(outside=outside, blocks=sum(per_block), largest_block=max(per_block, default=0),
                           block_inputs=sum(block_inputs))


def shape_from_spec(spec: ModelSpec, precision: str | None = None, meta: torch.nn.Module | None = None) -> ModelShape:
    """The memory model's view of `spec`; non-transformer activations are measured for `precision`. `meta`: the
    module on the meta device, when the caller has built it (`meta_module`)."""
    from bigtrain.models.registry import estimate_shape
    meta = meta_module(spec) if meta is None else meta
    numel, numels, largest = parameter_layout(meta)
    assert numel == spec.num_params, f"{spec.family} {spec.size}: counted {numel} parameters, spec {spec.num_params}"
    common = dict(family=spec.family, num_params=numel, param_numels=numels, largest_layer_params=largest,
                  linear_dims=linear_dims(meta), tensor_whole_params=tensor_whole_params(meta),
                  expert_params=expert_params(meta), muon_params=muon_params(meta))
    import torch
    dtypes = {4: torch.float32, 2: torch.bfloat16}
    sizes = [PRECISIONS[precision]] if precision else sorted(set(PRECISIONS.values()))
    savings = {e: tiled_mlp_saving(spec, dtypes[e]) for e in sizes}
    common.update(tiled_mlp_saving={e: saved for e, (saved, _) in savings.items()},
                  mlp_layers=max((n for _, n in savings.values()), default=0))
    analytic = estimate_shape(spec)  # the family's closed form, where it has one
    if analytic is not None:
        return ModelShape(**common, **analytic)
    measured = {e: measure_activations(spec, dtypes[e]) for e in sizes}
    return ModelShape(**common, measured=measured)


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
