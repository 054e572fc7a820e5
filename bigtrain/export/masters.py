"""fp32 master weights from ZeRO-1/2-style optimizer files, per model-parallel (pipeline) rank.

DeepSpeed's zero_to_fp32 reads only `mp_rank_00` and only files that record a ZeRO stage,
so it covers neither pipeline stages (one `mp_rank_XX` per stage) nor the BF16_Optimizer.
Both store, per data-parallel rank, `single_partition_of_fp32_groups`: one flat fp32
slice per parameter group; concatenated over ranks, a group is its parameters in
`param_shapes` order, each followed by its alignment padding (if recorded), then end
padding. The same protocol as zero_to_fp32's ZeRO-2 path, for any mp rank.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from bigtrain.checkpoint.safe_load import load_torch_file
from bigtrain.models import ModelSpec
from bigtrain.models.pipeline_form import first_tied_layers

_DP_RANK = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")


def optim_files(tag_dir: Path, mp_rank: int) -> list[Path]:
    """This mp rank's optimizer files, in data-parallel rank order."""
    pattern = f"*zero_pp_rank_*_mp_rank_{mp_rank:02d}_optim_states.pt"
    files = [p for p in tag_dir.glob(pattern) if _DP_RANK.search(p.name)]
    if not files:
        raise FileNotFoundError(f"no {pattern} in {tag_dir}")
    return sorted(files, key=lambda p: int(_DP_RANK.search(p.name).group(1)))


def zero_masters(tag_dir: Path, mp_rank: int) -> dict[str, torch.Tensor]:
    """{parameter name as the engine's module named it: fp32 master} for one mp rank."""
    model = load_torch_file(tag_dir / f"mp_rank_{mp_rank:02d}_model_states.pt", map_location="cpu", mmap=True)
    shapes = model["param_shapes"]
    groups, paddings = _flat_groups(optim_files(tag_dir, mp_rank))
    if len(groups) != len(shapes):
        raise ValueError(f"{tag_dir}: {len(groups)} fp32 groups in the optimizer files but {len(shapes)} "
                         f"parameter groups in mp_rank_{mp_rank:02d}_model_states.pt")
    out: dict[str, torch.Tensor] = {}
    for gi, (group_shapes, flat) in enumerate(zip(shapes, groups)):
        out.update(_split(flat, group_shapes, paddings[gi] if paddings else None, tag_dir))
    return out


def _flat_groups(files: list[Path]) -> tuple[list[torch.Tensor], list | None]:
    """Each group's whole flat fp32 vector (all dp partitions joined) and per-parameter paddings."""
    states = []
    for path in files:
        # mmap: only the fp32 partitions are read, not Adam's moments.
        state = load_torch_file(path, map_location="cpu", mmap=True)["optimizer_state_dict"]
        if int(state.get("zero_stage", 1)) > 2:
            raise ValueError(f"{path.name} is a ZeRO-3 file; its partitions are per parameter")
        states.append(state)
    count = states[0].get("partition_count", len(files))
    count = max(count) if isinstance(count, list) else int(count)
    if count != len(files):
        raise ValueError(f"expected {count} optimizer files for mp rank ({files[0].name}), found {len(files)}")
    n_groups = len(states[0]["single_partition_of_fp32_groups"])
    groups = [torch.cat([s["single_partition_of_fp32_groups"][g] for s in states]) for g in range(n_groups)]
    return groups, states[0].get("param_alignment_paddings")


def _split(flat: torch.Tensor, shapes: dict, paddings: list | None, where: Path) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for i, (name, shape) in enumerate(shapes.items()):
        numel = math.prod(shape)
        out[name] = flat.narrow(0, offset, numel).view(tuple(shape))  # views: one copy of the weights in RAM
        offset += numel + (paddings[i] if paddings else 0)
    if offset > flat.numel():
        raise ValueError(f"{where}: parameters need {offset} values but the fp32 partitions hold {flat.numel()}")
    return out


def pipeline_masters(tag_dir: Path, spec: ModelSpec, stages: int) -> dict[int, dict[str, torch.Tensor]]:
    """{layer index: local fp32 masters} over all pipeline stages.

    A stage's module names its parameters `"{layer}.{local}"`, or `"tied_modules.{key}.{local}"`
    for a tied layer (on every stage that holds it; the copies are equal, the first is kept).
    """
    owners = first_tied_layers(spec.layers())
    out: dict[int, dict[str, torch.Tensor]] = {}
    for stage in range(stages):
        for name, tensor in zero_masters(tag_dir, stage).items():
            head, rest = name.split(".", 1)
            if head == "tied_modules":
                key, local = rest.split(".", 1)
                idx = owners[key]
            else:
                idx, local = int(head), rest
            out.setdefault(idx, {}).setdefault(local, tensor)
    return out
