"""A vision-language model's image side in `bigtrain estimate`: its vision tower's parameters (in the table's params,
with the rest of the model's), the image tokens an image becomes at the processor's resolution (part of
data.seq_len, which the language model's activations are counted over like any token), and what the tower's forward
saves for backward per image, counted on the meta device from the processor's own image tensor: everything it saves
while it trains, the features it hands the projector when only the projector trains, nothing when both are frozen
(`model.overrides.freeze_vision`, `freeze_projector`). The table counts one image a sample.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from bigtrain.models.spec import ModelSpec


@dataclass(frozen=True)
class ImageSide:
    """One image through a vision-language model."""

    tower_params: int
    image_tokens: int  # of the sequence, per image
    pixels: tuple[int, ...]  # the processor's pixel tensor for one image
    saved_bytes: float  # what the tower's forward saves for backward, per image (in the dtype measured)
    trains: str  # what of the image side trains: "tower", "projector" or "nothing"


def image_side(spec: ModelSpec, dtype: torch.dtype) -> ImageSide | None:
    """The image side of `spec` (None for a model without one)."""
    if spec.modality != "vision" or not spec.source_dir:
        return None
    import torch

    from bigtrain.estimate.counting import meta_module
    from bigtrain.models.pixels import fixed_vision_inputs
    from bigtrain.models.vlm import part_names
    inputs, image_ids = fixed_vision_inputs(spec.source_dir, rows=1, with_image_ids=True)
    tokens = int(torch.isin(inputs["input_ids"], torch.tensor(image_ids)).sum())
    module = meta_module(spec).to(dtype)
    tower = module.get_submodule(part_names(module)["vision"][0])
    pixels = inputs["pixel_values"]
    frozen = set(spec.frozen_parts)
    trains = "tower" if "vision" not in frozen else "projector" if "projector" not in frozen else "nothing"
    saved = 0.0
    if trains != "nothing":
        flat = pixels.reshape(-1, *pixels.shape[-3:]).to("meta", dtype)  # Idefics3's [rows, images, ...] too
        saved = _saved_bytes(tower, flat, trains == "tower")
    return ImageSide(sum(p.numel() for p in tower.parameters()), tokens, tuple(pixels.shape), saved, trains)


def _saved_bytes(tower: Any, pixels: torch.Tensor, trained: bool) -> float:
    """What the tower's forward saves for backward (trained), or the features it outputs (a trained projector's
    input), on the meta device."""
    import torch
    for p in tower.parameters():
        p.requires_grad_(trained)
    keys = {p.untyped_storage()._cdata for p in tower.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key not in keys:
            saved.setdefault(key, t.untyped_storage().nbytes())
        return t

    from unittest import mock

    import transformers.masking_utils as masking

    from bigtrain.estimate.counting import _measuring
    # a tower's attention over every patch needs no mask: transformers checks so on the mask's values, which a meta
    # tensor cannot answer
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _measuring("meta"), \
            mock.patch.object(masking, "_ignore_bidirectional_mask_sdpa", lambda *a, **k: True):
        out = tower(pixel_values=pixels)
    if trained:
        return float(sum(saved.values()))
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return float(hidden.numel() * hidden.element_size())


def image_line(side: ImageSide) -> str:
    """The estimate's line about the image side."""
    what = {"tower": "the tower trains: what its forward saves", "projector":
            "the tower is frozen (model.overrides.freeze_vision), the projector trains: the tower's output features",
            "nothing": "tower and projector frozen: nothing"}[side.trains]
    held = f"{side.tower_params / 1e6:,.1f}M" if side.tower_params >= 1e6 else f"{side.tower_params:,}"
    return (f"images: the vision tower holds {held} of the parameters; an image "
            f"({'x'.join(map(str, side.pixels[-2:]))} pixels) becomes {side.image_tokens} image tokens of data.seq_len; "
            f"acts add {side.saved_bytes / 2**20:,.2f} MiB a sample for one image ({what})")
