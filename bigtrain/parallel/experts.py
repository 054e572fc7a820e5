"""Expert parallelism (DeepSpeed AutoEP, `"expert_parallel": {"enabled": true, "autoep_size": N}`), from outside the
model: DeepSpeed's engine swaps each mixture-of-experts block of a model it has a preset for (Mixtral, Qwen3-MoE,
DeepSeek-V2/V3, ...) for its own layer that keeps N-th of the experts per rank and all-to-alls the tokens; the dense
weights stay data-parallel over every rank. bigtrain checks the model has a preset before any rank builds it, and
carries one compatibility fix, for the conversion only, until DeepSpeed has it (`output_capture_lookups`).
"""
from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Iterator

log = logging.getLogger(__name__)

# The versions the fix below was made against; `output_capture_lookups` checks the behaviour, not these.
PATCHED_AGAINST = "deepspeed 0.19.8 with transformers 5.23-5.24"


def autoep_preset(config: Any) -> str | None:
    """DeepSpeed's AutoEP preset for a Hugging Face config (None: AutoEP has none for its model type)."""
    from deepspeed.module_inject.auto_ep_presets.registry import preset_name_for_hf_model_type
    model_type = getattr(config, "model_type", None)
    return preset_name_for_hf_model_type(model_type) if model_type else None


def expert_problem(config: Any, size: int) -> str | None:
    """One line when the model cannot be split over `size` expert ranks: no AutoEP preset, or experts that do not
    divide by `size`; None when it can."""
    from deepspeed.module_inject.auto_ep_presets.registry import (PRESET_MODELS, available_preset_names,
                                                                  unsupported_preset_for_hf_model_type)
    text = getattr(config, "get_text_config", lambda: config)()
    model_type = getattr(text, "model_type", None) or getattr(config, "model_type", None)
    preset = autoep_preset(text) or autoep_preset(config)
    if preset is None:
        unsupported = unsupported_preset_for_hf_model_type(model_type) if model_type else None
        why = f" ({unsupported[1].unsupported_hf_model_type_notes[model_type]})" if unsupported else ""
        return (f"parallel.expert={size}: DeepSpeed's AutoEP has no preset for model type {model_type!r}{why}; it has "
                f"{', '.join(available_preset_names())}; set parallel.expert=1 (ZeRO partitions the experts)")
    experts = getattr(text, PRESET_MODELS[preset].num_experts_attr, None)
    if isinstance(experts, int) and experts % size:
        return (f"parallel.expert={size}: the model's {experts} experts do not divide over {size} ranks; choose "
                f"parallel.expert dividing {experts}")
    return None


@contextlib.contextmanager
def output_capture_lookups() -> Iterator[bool]:
    """While DeepSpeed's AutoEP converts a model (inside `deepspeed.initialize`), let it read transformers'
    output-capture registry; afterwards the registry is as it was, so that no other model of the process (a
    reference, a reward model, a teacher, the next job's) runs with the change. Yields whether it was needed.

    transformers 5.23+ keys `_CAN_RECORD_REGISTRY` by model through `get(model)` (one argument, the model's class
    name taken from it), while DeepSpeed 0.19.8's AutoEP (`auto_ep_presets/base.py`) reads it as a plain dict,
    `registry.get(class_name, default)`: a TypeError when AutoEP converts Mixtral/Qwen3-MoE (the probe's crash), and
    the router-logit recorders it retargets would be looked up under the wrong key. For the conversion `get` also
    takes a class-name string and a default, as a dict does; a model is looked up as before. Only while the
    registry's `get` refuses a default (the behaviour, not a version, decides: a transformers or DeepSpeed that
    agrees needs nothing)."""
    try:
        from transformers.utils import output_capturing
    except ImportError:
        yield False
        return
    registry_type = type(getattr(output_capturing, "_CAN_RECORD_REGISTRY", None))
    original = registry_type.__dict__.get("get")  # the class's own (a dict's is left alone)
    if original is None or _takes_a_default(registry_type):
        yield False
        return

    @functools.wraps(original)
    def get(self: dict, key: Any, default: Any = None) -> Any:
        if isinstance(key, str):
            return dict.get(self, key, default)
        found = original(self, key)
        return found if found or default is None else default

    registry_type.get = get
    log.info("AutoEP: transformers' output-capture registry takes DeepSpeed's dict-style lookups while it converts "
             "the model (%s)", PATCHED_AGAINST)
    try:
        yield True
    finally:
        registry_type.get = original


def _takes_a_default(registry_type: type) -> bool:
    try:
        registry_type().get("probe", None)
    except TypeError:
        return False
    return True


def to_transformers_names(tensors: dict[str, Any], config: Any,
                          hf_shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """A state dict of a model AutoEP converted, under the names and layouts of the model transformers builds.

    Per mixture-of-experts block AutoEP holds `router.gate.*` (and an alias of it under the model's router name,
    `gate.gate.*`), the experts as `experts.w1/w2/w3` ([experts, ffn, hidden] gate, [experts, hidden, ffn] down,
    [experts, ffn, hidden] up: DeepSpeed's `moe/ep_repack.py`) and the shared experts as `shared_experts[_gate]`;
    the model's own names come from the AutoEP preset (router, experts, expert weights, shared experts), the fused
    gate/up orientation from the shapes transformers builds (`hf_shapes`). `tensors` holds whole experts (a
    universal checkpoint merges every rank's)."""
    from deepspeed.module_inject.auto_ep_presets.registry import PRESET_MODELS
    text = getattr(config, "get_text_config", lambda: config)()
    preset = PRESET_MODELS[autoep_preset(text) or autoep_preset(config)]
    blocks = sorted({name[:-len(".experts.w1")] for name in tensors if name.endswith(".experts.w1")})
    renamed = {"router.gate.": f"{preset.router_pattern}.", "shared_experts.": f"{preset.shared_experts_pattern}.",
               "shared_experts_gate.": f"{preset.shared_experts_gate_pattern}."}
    out: dict[str, Any] = {}
    for name, tensor in tensors.items():
        block = next((b for b in blocks if name.startswith(b + ".")), None)
        rest = name[len(block) + 1:] if block else ""
        if block is None:
            out[name] = tensor
        elif rest.startswith(f"{preset.router_pattern}.gate.") or rest.startswith("experts.w"):
            continue  # the router's alias (the same tensor), and the experts below
        else:
            prefix = next((p for p in sorted(renamed, key=len, reverse=True) if rest.startswith(p)), None)
            out[f"{block}.{renamed[prefix]}{rest[len(prefix):]}" if prefix else name] = tensor
    for block in blocks:
        out.update(_experts_as_transformers(block, preset, [tensors[f"{block}.experts.w{i}"] for i in (1, 2, 3)],
                                            hf_shapes))
    return out


def _experts_as_transformers(block: str, preset: Any, weights: list[Any], hf_shapes: dict) -> dict[str, Any]:
    """One block's experts in the model's layout: gate and up fused along the ffn axis (or kept apart where the
    model keeps them so), down as is, each transposed where transformers stores [experts, in, out]."""
    import torch
    gate, down, up = weights
    where = f"{block}.{preset.experts_pattern}"

    def fitted(name: str, tensor: torch.Tensor) -> torch.Tensor:
        want = tuple(hf_shapes[f"{where}.{name}"])
        if tuple(tensor.shape) == want:
            return tensor
        if tuple(tensor.transpose(1, 2).shape) == want:
            return tensor.transpose(1, 2).contiguous()
        raise ValueError(f"{where}.{name}: AutoEP's experts {tuple(tensor.shape)} do not fit the model's {want}; "
                         "export the run with the DeepSpeed and transformers versions it trained with")

    out = {f"{where}.{preset.expert_w2}": fitted(preset.expert_w2, down)}
    if preset.expert_w3 is None:
        out[f"{where}.{preset.expert_w1}"] = fitted(preset.expert_w1, torch.cat([gate, up], dim=1))
    else:
        out[f"{where}.{preset.expert_w1}"] = fitted(preset.expert_w1, gate)
        out[f"{where}.{preset.expert_w3}"] = fitted(preset.expert_w3, up)
    return out
