"""One sample's activations counted on the meta device (no memory, no weights): what a forward saves for backward,
by block (`measure_activations`), and the peak of a whole forward and backward, every tensor counted while it lives
(`measure_peaks`, with `bigtrain.estimate.live_bytes`: the accounting scripts/profile_alst.py measures real training
steps with), with the levers training applies (ALST's tiled MLP, the chunked loss, checkpointing). `count_activations`
joins them into the memory model's `ActivationCount` (`bigtrain.estimate.shape` builds the shape from it).
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from bigtrain.estimate.activations import ActivationCount

if TYPE_CHECKING:  # torch is imported where it is used: `bigtrain estimate --help` starts without it
    from collections.abc import Iterator

    import torch

    from bigtrain.models.spec import ModelSpec


def meta_module(spec: ModelSpec, layers: int | None = None) -> torch.nn.Module:
    """The module on the meta device. A pretrained model's `construct` loads weights, which the meta
    device cannot hold: its shape is built from the config instead (nothing is read but config.json). `layers`:
    the same model with this many decoder layers (a transformers model's config says how many)."""
    import torch
    construct = getattr(spec, "construct", None) or spec.build
    if layers is not None:
        import copy
        config = copy.deepcopy(spec.config)
        config.get_text_config().num_hidden_layers = layers
        with torch.device("meta"):
            return spec.hf_class._from_config(config)
    if spec.pretrained or spec.source_dir:
        hf_class = getattr(spec, "hf_class", None) or type(None)
        if hasattr(hf_class, "_from_config"):
            with torch.device("meta"):
                return hf_class._from_config(spec.config)
    with torch.device("meta"):
        return construct()


def _sample_batch(spec: ModelSpec, device: str) -> dict:
    import torch
    with torch.device(device):
        if spec.modality == "image":
            size = spec.image_size
            return {"pixel_values": torch.zeros(1, 3, size, size), "labels": torch.zeros(1, dtype=torch.long)}
        ids = torch.zeros(1, spec.seq_len, dtype=torch.long)
        if spec.modality in ("text", "vision"):  # a vision-language model's image tokens: the sequence's own
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
            # [batch, heads, tokens, width] over memory laid out [batch, tokens, heads, width], as the kernels
            # write it: the caller's transpose back is then free, as after them
            out = q.new_empty(q.shape[0], q.shape[2], q.shape[1], v.shape[-1]).transpose(1, 2)
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
    count = mlp_count(spec)
    if not count:  # nothing to tile (a mixture of experts' blocks are not MLPs here)
        return 0.0, 0
    plain = measure_activations(spec, dtype)
    tiled = measure_activations(spec, dtype, tile=spec.hidden_size)
    return max(0.0, plain.blocks - tiled.blocks) / count, count


def mlp_count(spec: ModelSpec) -> int:
    """How many MLPs ALST's tiling would compute in tiles (0 for a model that is not a text transformer)."""
    if spec.modality != "text" or not spec.seq_len or not spec.hidden_size:
        return 0
    from bigtrain.parallel.tiling import mlp_modules
    return len(mlp_modules(meta_module(spec)))


def _step_module(spec: ModelSpec, dtype: torch.dtype, device: str, tile: int, layers: int | None = None
                 ) -> torch.nn.Module:
    """The module a measurement runs: on `device`, in `dtype`, training, with ALST's tiled MLP as the engine
    applies it (`tile` tokens; 0: none; the lean RMSNorms with it); with `layers` decoder layers (meta only)."""
    module = (meta_module(spec, layers) if device == "meta" else spec.build()).to(dtype).train()
    if tile:
        from bigtrain.parallel.tiling import apply_tiles
        apply_tiles(module, tile)
    return module


def _loss(spec: ModelSpec, module: torch.nn.Module, device: str, dtype: torch.dtype, chunked: bool) -> Any:
    """One sample's loss: the model's own (plain) or the chunked causal-LM loss (bigtrain.models.chunked_loss)."""
    batch = _sample_batch(spec, device)
    if spec.modality == "image":
        batch["pixel_values"] = batch["pixel_values"].to(dtype)
    inputs, labels = spec.batch_to_inputs(batch)
    if chunked:
        from bigtrain.models.chunked_loss import causal_lm_hidden_loss
        return causal_lm_hidden_loss(module, (), inputs if isinstance(inputs, dict) else {"input_ids": inputs},
                                     labels)
    return spec.loss(module(**inputs) if isinstance(inputs, dict) else module(inputs), labels)


def measure_activations(spec: ModelSpec, dtype: torch.dtype, device: str = "meta", tile: int = 0,
                        chunked: bool = False, layers: int | None = None) -> ActivationCount:
    """Bytes saved for backward by one sample, counted from the saved tensors of a forward on `device` (with ALST's
    tiled MLP over `tile` tokens, with the chunked loss).

    Parameters are not activations and are left out; every storage counts once. Blocks are
    `spec.checkpoint_blocks`; a block's input is what checkpointing keeps of it. On the meta device sdpa saves
    what training's fused kernels save (`_fused_sdpa`); an eager attention saves its probabilities either way.
    """
    import torch
    module = _step_module(spec, dtype, device, tile, layers)
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

    def enter(i: int, args: tuple, kwargs: dict) -> None:
        where.append(i)
        block_inputs.append((args[0] if args else next(iter(kwargs.values()))).untyped_storage().nbytes())

    def leave(*_: Any) -> None:
        where.pop()

    hooks = []
    for i, block in enumerate(blocks):
        hooks.append(block.register_forward_pre_hook(lambda m, args, kwargs, i=i: enter(i, args, kwargs),
                                                     with_kwargs=True))
        hooks.append(block.register_forward_hook(leave))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _measuring(device):
        _loss(spec, module, device, dtype, chunked)
    for h in hooks:
        h.remove()
    per_block = [sum(b for b, w in saved.values() if w == i) for i in range(len(blocks))]
    outside = sum(b for b, w in saved.values() if w == -1)
    return ActivationCount(outside=outside, blocks=sum(per_block), largest_block=max(per_block, default=0),
                           block_inputs=sum(block_inputs))


@contextlib.contextmanager
def _measuring(device: str) -> Iterator[None]:
    """What a forward on `device` needs to count what training's kernels hold (see each)."""
    with contextlib.ExitStack() as stack:
        if device == "meta":
            stack.enter_context(_fused_sdpa())
        stack.enter_context(_no_packed_sequence_probe(device))
        stack.enter_context(_plain_grouped_mm(device))
        yield


def measure_peaks(spec: ModelSpec, dtype: torch.dtype, device: str = "meta", tile: int = 0, chunked: bool = False,
                  checkpointing: bool = False, layers: int | None = None) -> tuple[int, int]:
    """(the peak bytes of one sample's forward and backward on `device` before the first parameter gradient, the
    peak from it on), every tensor the step makes counted while it lives (`bigtrain.estimate.live_bytes.LiveBytes`,
    as scripts/profile_alst.py counts real training steps); with every block checkpointed as the engine does
    (`_reentrant_checkpoint`); with `layers` decoder layers. The two differ in what sits beside them: ZeRO 1-2 make
    their gradient bucket at the first gradient, so a loss's backward over the vocabulary, before it, can peak
    higher without being the step's peak. Parameter gradients are freed as they are made, as DeepSpeed's engine
    moves them into its buckets (counted with the model states)."""
    import torch

    from bigtrain.estimate.live_bytes import LiveBytes, peaks_around
    module = _step_module(spec, dtype, device, tile, layers)
    if checkpointing:
        for parent, name in spec.checkpoint_blocks(module) if spec.checkpoint_blocks else []:
            getattr(parent, name).forward = _reentrant_checkpoint(getattr(parent, name).forward)
    first_grad: list[int] = []

    def made(p: torch.nn.Parameter) -> None:
        if not first_grad:
            first_grad.append(len(watch.events))
        p.grad = None

    hooks = [p.register_post_accumulate_grad_hook(made) for p in module.parameters() if p.requires_grad]
    with _measuring(device), LiveBytes() as watch:
        _loss(spec, module, device, dtype, chunked).backward()
    for hook in hooks:
        hook.remove()
    return peaks_around(watch.events, first_grad[0] if first_grad else len(watch.events))


def _reentrant_checkpoint(forward: Any) -> Any:
    """`forward` checkpointed the way DeepSpeed's `checkpoint` does it for the engine (bigtrain.parallel.
    checkpointing): reentrant, so that backward recomputes a whole block and then runs its backward. (DeepSpeed's own
    copies its inputs to the accelerator, which a meta tensor cannot be; torch's reentrant checkpoint is the same
    recompute. Keyword tensors, the positions, need no gradient.)"""
    import torch

    def run(*args: Any, **kwargs: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(functools.partial(forward, **kwargs), *args, use_reentrant=True,
                                                 preserve_rng_state=False)
    return run


# Sequences up to this long are counted at their length; longer ones at a quarter, half and all of it, and the
# count extrapolated by the parabola through those three (exact for what grows linearly, as everything does with
# fused attention, and for an eager attention's square): a meta forward and backward of 131K tokens in tiles costs
# tens of seconds of Python per count.
COUNTED_UP_TO = 8192


def count_activations(spec: ModelSpec, dtype: torch.dtype, tile: int = 0, chunked: bool = False) -> ActivationCount:
    """One sample's activations on the meta device: what the forward saves, by block (`measure_activations`), and
    what the peak of the step holds beyond it, without and with checkpointing (`measure_peaks`)."""
    length = spec.seq_len or 0
    if spec.modality != "text" or length <= COUNTED_UP_TO:
        return _count_at(spec, dtype, tile, chunked)
    points = (COUNTED_UP_TO // 4, COUNTED_UP_TO // 2, COUNTED_UP_TO)
    counts = [_count_at(replace(spec, seq_len=n), dtype, tile, chunked) for n in points]
    fields = ("outside", "blocks", "largest_block", "block_inputs", "transient", "transient_checkpointed",
              "transient_after", "transient_checkpointed_after")
    return ActivationCount(**{f: _parabola(points, [getattr(c, f) for c in counts], length) for f in fields})


def _parabola(xs: tuple[int, ...], ys: list[float], x: float) -> float:
    """The value at `x` of the parabola through three points (Lagrange)."""
    (x0, x1, x2), (y0, y1, y2) = xs, ys
    return (y0 * (x - x1) * (x - x2) / ((x0 - x1) * (x0 - x2)) + y1 * (x - x0) * (x - x2) / ((x1 - x0) * (x1 - x2))
            + y2 * (x - x0) * (x - x1) / ((x2 - x0) * (x2 - x1)))


def _count_at(spec: ModelSpec, dtype: torch.dtype, tile: int, chunked: bool) -> ActivationCount:
    count = measure_activations(spec, dtype, tile=tile, chunked=chunked)
    if spec.modality != "text":  # an image, classification or vision-language model: the saved tensors
        return count
    # The peaks beyond the saved tensors come from a backward, which costs what a forward does and more: where the
    # decoder's blocks are alike, a two-block copy of it holds the same beyond what it saves (the last block's
    # backward, the loss's), so it is measured instead; where they are not (a mixture of experts every other
    # layer, alternating attention), the whole model is.
    probe, layers = count, None
    if _alike_blocks(spec, count):
        smaller = measure_activations(spec, dtype, tile=tile, chunked=chunked, layers=2)
        if (smaller.outside, smaller.largest_block) == (count.outside, count.largest_block):
            probe, layers = smaller, 2
    plain = measure_peaks(spec, dtype, tile=tile, chunked=chunked, layers=layers)
    kept = measure_peaks(spec, dtype, tile=tile, chunked=chunked, checkpointing=spec.checkpoint_blocks is not None,
                         layers=layers)
    saved, saved_kept = probe.outside + probe.blocks, probe.outside + probe.block_inputs + probe.largest_block
    return replace(count, transient=plain[0] - saved, transient_checkpointed=kept[0] - saved_kept,
                   transient_after=plain[1] - saved, transient_checkpointed_after=kept[1] - saved_kept)


def _alike_blocks(spec: ModelSpec, count: ActivationCount) -> bool:
    """Whether `spec` is a transformers decoder of more than two blocks that each save the same."""
    config = getattr(spec.config, "get_text_config", lambda: None)()
    blocks = getattr(config, "num_hidden_layers", 0) or 0
    return (blocks > 2 and hasattr(getattr(spec, "hf_class", None), "_from_config") and count.largest_block > 0
            and count.blocks == blocks * count.largest_block and count.block_inputs % blocks == 0)
