"""One plain (non-pipeline) state dict from DeepSpeed's per-rank checkpoint files, on CPU.

Layouts, recognised from the files of one tag:
  zero3     zero_pp_rank_*_mp_rank_00_model_states.pt: DeepSpeed's zero_to_fp32 (fp32 master copy)
  zero      mp_rank_00_model_states.pt + *zero_pp_rank_*_optim_states.pt (ZeRO-1/2): zero_to_fp32
  plain     mp_rank_00_model_states.pt alone (ZeRO-0): its 'module' weights
  pipeline  layer_XX-model_states.pt (one per layer, local names) mapped back with the spec
  tensor    mp_rank_01_* files beside mp_rank_00_*: tensor-parallel shards (AutoTP), which zero_to_fp32 cannot
            merge; DeepSpeed's ds_to_universal can, into CKPT/step_N_universal/ (the copy a resume at another
            shape would make too: reused, and the only thing written), whose fp32.pt files are whole parameters
Nothing here needs a process group, and nothing writes into the checkpoint's own directory.

Tensors may come back lazy (DeepSpeed's GatheredTensor for ZeRO-3): call `.contiguous()`
on each when it is needed, so only one whole parameter is materialised at a time.
"""
from __future__ import annotations

import contextlib
import io
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bigtrain.checkpoint.safe_load import load_torch_file
from bigtrain.export.masters import pipeline_masters, zero_masters
from bigtrain.models import ModelSpec, module_state_from_pipeline
from bigtrain.models.pipeline_form import first_tied_layers

LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass
class Consolidated:
    """name -> tensor (or lazy tensor with `.contiguous()`), the layout, and notes for the user."""

    tensors: dict[str, Any]
    layout: str
    notes: list[str] = field(default_factory=list)


def detect_layout(tag_dir: Path) -> str:
    """'pipeline' | 'tensor' | 'zero3' | 'zero' | 'plain'; ValueError for anything else."""
    if any(tag_dir.glob("layer_*-model_states.pt")):
        return "pipeline"
    if any(tag_dir.glob("*mp_rank_01_model_states.pt")):
        return "tensor"
    if _autoep(tag_dir):
        return "experts"
    if (tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt").is_file():
        return "zero3"
    if (tag_dir / "mp_rank_00_model_states.pt").is_file():
        return "zero" if any(tag_dir.glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt")) else "plain"
    files = sorted(p.name for p in tag_dir.iterdir())
    raise ValueError(f"{tag_dir}: unknown checkpoint layout (files: {', '.join(files[:8]) or 'none'}); expected "
                     "DeepSpeed's mp_rank_00_model_states.pt, zero_pp_rank_*_model_states.pt "
                     "or layer_*-model_states.pt")


def consolidate(tag_dir: Path, spec: ModelSpec, pipeline_stages: int) -> Consolidated:
    """The plain module's state dict from the checkpoint in `tag_dir`, fp32 master weights where DeepSpeed kept them."""
    layout = detect_layout(tag_dir)
    if (layout == "pipeline") != (pipeline_stages > 1):
        raise ValueError(f"{tag_dir}: its files are a {layout} checkpoint but bigtrain.json says "
                         f"pipeline_stages={pipeline_stages}; the checkpoint directory is mixed up")
    printed = io.StringIO()  # zero_to_fp32's and the universal converter's progress: shown only when they fail
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            if layout == "pipeline":
                return _pipeline(tag_dir, spec, pipeline_stages)
            if layout == "plain":
                return _plain(tag_dir)
            if layout == "tensor":
                return _tensor_parallel(tag_dir)
            if layout == "experts":
                return _expert_parallel(tag_dir, spec)
            return _zero(tag_dir, layout)
    except BaseException:
        sys.stderr.write(printed.getvalue())
        raise


def _tensor_parallel(tag_dir: Path) -> Consolidated:
    """Whole fp32 parameters of a tensor-parallel checkpoint, through DeepSpeed's universal conversion; for ZeRO-3,
    the weights gathered at save time (`store.TP_WEIGHTS`: 16-bit in a bf16 run)."""
    from deepspeed.checkpoint.constants import PARAM

    from bigtrain.checkpoint.store import TP_WEIGHTS
    from bigtrain.checkpoint.universal import convert_to_universal
    if (tag_dir / TP_WEIGHTS).is_file():
        weights = load_torch_file(tag_dir / TP_WEIGHTS)
        return Consolidated(dict(weights), "tensor", ["weights gathered over the tensor-parallel and ZeRO-3 ranks at "
                                                      "save time (the run's training precision)"])
    universal, _ = convert_to_universal(tag_dir.parent, tag_dir.name)
    tensors = {}
    for param_dir in sorted(p for p in (universal / "zero").iterdir() if (p / "fp32.pt").is_file()):
        saved = load_torch_file(param_dir / "fp32.pt")
        tensors[param_dir.name] = saved[PARAM] if isinstance(saved, dict) else saved
    return Consolidated(tensors, "tensor", [f"fp32 master weights, tensor-parallel shards merged by DeepSpeed's "
                                            f"ds_to_universal ({universal})"])


def _autoep(tag_dir: Path) -> bool:
    """Whether DeepSpeed's AutoEP trained the checkpoint (`bigtrain.parallel.experts`): bigtrain.json's DeepSpeed
    config enables expert_parallel with more than one rank per expert group."""
    marker = tag_dir / "bigtrain.json"
    if not marker.is_file():
        return False
    import json

    from bigtrain.config.topology import Topology
    ds_config = json.loads(marker.read_text()).get("ds_config") or {}
    return Topology.of(ds_config, 1).expert > 1


def _expert_parallel(tag_dir: Path, spec: ModelSpec) -> Consolidated:
    """Whole experts under transformers' names: DeepSpeed's universal conversion merges every rank's experts (and
    the ZeRO partitions) into fp32 tensors under AutoEP's names, which `to_transformers_names` maps back."""
    import copy

    from deepspeed.checkpoint.constants import PARAM

    from bigtrain.checkpoint.universal import convert_to_universal
    from bigtrain.parallel.experts import to_transformers_names
    if not any(tag_dir.glob("*optim_states.pt")):
        raise ValueError(f"{tag_dir}: an expert-parallel ZeRO-0 checkpoint keeps no optimizer partitions for "
                         "DeepSpeed's universal conversion, which merges the experts; train with zero.stage 1-3 to "
                         "export expert-parallel runs")
    universal, _ = convert_to_universal(tag_dir.parent, tag_dir.name)
    tensors = {}
    for param_dir in sorted(p for p in (universal / "zero").iterdir() if (p / "fp32.pt").is_file()):
        saved = load_torch_file(param_dir / "fp32.pt")
        tensors[param_dir.name] = saved[PARAM] if isinstance(saved, dict) else saved
    zero3 = tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    if zero3.is_file():  # ZeRO-3's universal tensors stay flat; the dense ones' shapes are in its model states
        for group in load_torch_file(zero3, map_location="cpu", mmap=True).get("param_shapes") or []:
            for name, shape in group.items():
                if name in tensors and tensors[name].dim() == 1 and len(shape) > 1:
                    tensors[name] = tensors[name].view(tuple(shape))
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in spec.hf_class(copy.deepcopy(spec.config)).named_parameters()}
    return Consolidated(to_transformers_names(tensors, spec.config, shapes), "experts",
                        [f"fp32 master weights, every rank's experts merged by DeepSpeed's ds_to_universal "
                         f"({universal}) and named as transformers names them"])


def _zero(tag_dir: Path, layout: str) -> Consolidated:
    if layout == "zero" and any(tag_dir.glob("bf16_zero_pp_rank_*_optim_states.pt")):
        # DeepSpeed's BF16_Optimizer (bf16 + fp32 gradient accumulation): zero_to_fp32 does not read its
        # files, but they hold the same flat fp32 partitions as ZeRO-1/2.
        return Consolidated(_module_with_masters(tag_dir), layout, ["fp32 master weights (BF16_Optimizer state)"])
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    tensors = dict(get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag_dir.name, lazy_mode=True))
    notes = ["fp32 master weights (DeepSpeed zero_to_fp32)"]
    if layout == "zero":
        frozen = _frozen_from_module(tag_dir, tensors)
        if frozen:
            tensors.update(frozen)
            notes.append(f"{len(frozen)} frozen tensors (no optimizer state, e.g. a LoRA run's base) from the saved "
                         "module, as trained")
    return Consolidated(tensors, layout, notes)


def _frozen_from_module(tag_dir: Path, tensors: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Parameters that no optimizer holds (requires_grad off: a LoRA run's base): at ZeRO-1 DeepSpeed records
    them nowhere but in the saved module, which zero_to_fp32 does not read, and they never change."""
    saved = load_torch_file(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", mmap=True)
    if saved.get("frozen_param_shapes"):  # ZeRO-2 records them, and zero_to_fp32 has read them already
        return {}
    return {name: t for name, t in saved["module"].items() if name not in tensors}


def _module_with_masters(tag_dir: Path) -> dict[str, torch.Tensor]:
    """The saved module (buffers, 16-bit weights) with every trained parameter replaced by its fp32 master."""
    saved = load_torch_file(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", mmap=True)
    tensors = dict(saved["module"])
    masters = zero_masters(tag_dir, mp_rank=0)
    strays = sorted(set(masters) - set(tensors))
    assert not strays, f"optimizer parameters not in the saved module: {strays[:5]}"
    tensors.update(masters)
    for alias, source in saved.get("shared_params", {}).items():  # tied weights: one tensor, two names
        tensors[alias] = tensors[source]
    return tensors


def _plain(tag_dir: Path) -> Consolidated:
    saved = load_torch_file(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", mmap=True)
    module = saved.get("module")
    if not isinstance(module, dict) or not module:
        raise ValueError(f"{tag_dir / 'mp_rank_00_model_states.pt'} holds no module weights; "
                         "unknown checkpoint layout")
    notes = ["ZeRO-0 checkpoint: module weights"]
    if any(t.dtype in LOW_PRECISION for t in module.values()):
        notes.append("the weights were saved in 16-bit and are exported upcast to fp32 "
                     "(ZeRO-0 keeps no fp32 copy in a form we read)")
    return Consolidated(dict(module), "plain", notes)


def _pipeline(tag_dir: Path, spec: ModelSpec, stages: int) -> Consolidated:
    layer_states = pipeline_layer_states(tag_dir, spec)
    notes = [f"pipeline checkpoint: {len(layer_states)} layer files"]
    if any(t.dtype in LOW_PRECISION for s in layer_states.values() for t in s.values()):
        notes.append(_use_masters(tag_dir, spec, stages, layer_states))
    return Consolidated(module_state_from_pipeline(spec, layer_states), "pipeline", notes)


def pipeline_layer_states(tag_dir: Path, spec: ModelSpec) -> dict[int, dict[str, torch.Tensor]]:
    """{layer index: local state} from `layer_XX-model_states.pt`, for every layer that owns weights."""
    defs = spec.layers()
    owners = first_tied_layers(defs)
    states: dict[int, dict[str, torch.Tensor]] = {}
    for idx, d in enumerate(defs):
        if not d.param_map or (d.tie_key is not None and owners[d.tie_key] != idx):
            continue
        path = tag_dir / f"layer_{idx:02d}-model_states.pt"
        if not path.is_file():
            raise ValueError(f"{tag_dir}: {path.name} is missing; the pipeline checkpoint does not match "
                             f"{spec.family}/{spec.size} ({len(defs)} layers)")
        states[idx] = load_torch_file(path, map_location="cpu", mmap=True)
    return states


def _use_masters(tag_dir: Path, spec: ModelSpec, stages: int, layer_states: dict[int, dict]) -> str:
    """Swap 16-bit layer weights for the optimizer's fp32 masters, if they check out exactly."""
    try:
        masters = pipeline_masters(tag_dir, spec, stages)
    except (FileNotFoundError, KeyError, ValueError) as err:
        return f"16-bit layer weights exported upcast to fp32 (no fp32 masters readable: {err})"
    for idx, local in masters.items():
        for name, master in local.items():
            saved = layer_states.get(idx, {}).get(name)
            # The 16-bit weight is the master rounded: anything else means we misread the partitions.
            if saved is None or saved.shape != master.shape or not torch.equal(master.to(saved.dtype), saved):
                return f"16-bit layer weights exported upcast to fp32 (fp32 masters do not match at layer {idx} {name})"
    for idx, local in masters.items():
        layer_states[idx] = {**layer_states[idx], **local}
    return "fp32 master weights from the pipeline stages' ZeRO optimizer states"
