"""Resuming at another shape (world size, ZeRO stage, optimizer offload) through DeepSpeed's universal checkpoint.

A ZeRO checkpoint holds each rank's slice of the flattened optimizer state, so DeepSpeed can
load it only at the data-parallel size and stage it was saved with. When `--resume` finds a
checkpoint saved at another shape, rank 0 converts it once with DeepSpeed's `ds_to_universal`
into CKPT/step_N_universal/ (one fp32 / exp_avg / exp_avg_sq file per parameter), and every
rank loads that with `checkpoint.load_universal`, re-slicing it for the new shape. Since that
switch is part of the DeepSpeed config, the plan (`bigtrain.checkpoint.resume`) is made before the
engine is created.

What is not convertible fails with a ValueError before any rank trains (`resume.needs_universal`):
- ZeRO-0 checkpoints keep the whole optimizer state in one file, with no partitions for
  ds_to_universal to read; they need no conversion at another world size either (ZeRO-0 to
  ZeRO-0 loads as is), but cannot move to ZeRO 1-3 (nor can ZeRO 1-3 move to ZeRO-0, which
  DeepSpeed never loads universal checkpoints into);
- pipeline checkpoints: their parameters are named by pipeline layer, not by the plain
  module's names, so a shape change involving a pipeline has no mapping here.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from bigtrain.atomic import write_atomic
from bigtrain.checkpoint import store as checkpoint
from bigtrain.checkpoint.safe_load import checkpoint_loading, load_torch_file
from bigtrain.distributed.world import World

log = logging.getLogger("bigtrain")
SUFFIX = "_universal"
MARKER = "bigtrain_universal.json"  # written last: the conversion is complete


def convert_to_universal(ckpt_dir: Path, tag: str, trust: bool = False) -> tuple[Path, bool]:
    """CKPT/<tag> -> CKPT/<tag>_universal, once: (path, whether a complete one already existed).

    Written into a temporary directory, completed with a marker and renamed into place, so a
    crash mid-conversion leaves nothing that a later resume would take for complete. DeepSpeed's
    reads of the checkpoint are weights-only unless `trust` (see `safe_load`).
    """
    from deepspeed.checkpoint import ds_to_universal

    final = Path(ckpt_dir) / (tag + SUFFIX)
    source = hashlib.sha256((Path(ckpt_dir) / tag / checkpoint.MARKER).read_bytes()).hexdigest()
    if (final / MARKER).is_file() and json.loads((final / MARKER).read_text()).get("source_marker") == source:
        return final, True  # converted before (a rewritten checkpoint of the same step has another marker)
    tmp = _tmp_dir(Path(ckpt_dir), tag)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    args = argparse.Namespace(input_folder=str(Path(ckpt_dir) / tag), output_folder=str(tmp),
                              num_extract_workers=1, num_merge_workers=1,  # no forks from inside a rank
                              keep_temp_folder=False, strict=True,
                              inject_missing_state=True)  # the version tag non-Megatron models lack
    with checkpoint_loading(Path(ckpt_dir) / tag, trust):
        with open(tmp / "convert.log", "w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            ds_to_universal.main(args)
        _loadable_by_every_stage(tmp)
    (tmp / MARKER).write_text(json.dumps({"source": tag, "source_marker": source}))
    shutil.rmtree(final, ignore_errors=True)  # a stale conversion of an older checkpoint of this step
    tmp.replace(final)
    # ds_to_universal names its temporary folder in `latest_universal`; point it at the real one.
    write_atomic(Path(ckpt_dir) / "latest_universal", final.name)
    _remove_orphans(Path(ckpt_dir))
    return final, False


def convert_collectively(ckpt_dir: Path, tag: str, world: World, trust: bool) -> tuple[Path, bool]:
    """Rank 0 converts; its outcome (or its error) reaches every rank, so none waits forever."""
    outcome: list = [None]
    if world.is_main:
        try:
            path, reused = convert_to_universal(ckpt_dir, tag, trust)
            outcome = [(str(path), reused, None)]
        except Exception as err:  # noqa: BLE001 -- passed to every rank and raised there
            outcome = [(None, False, f"{type(err).__name__}: {err}")]
    if world.size > 1:
        torch.distributed.broadcast_object_list(outcome, src=0)
    path, reused, error = outcome[0]
    if error is not None:
        raise RuntimeError(f"converting checkpoint {Path(ckpt_dir) / tag} to a universal checkpoint failed on "
                           f"rank 0: {error} (DeepSpeed's output: {_tmp_dir(Path(ckpt_dir), tag) / 'convert.log'})")
    return Path(path), reused


def _loadable_by_every_stage(folder: Path) -> None:
    """Complete ds_to_universal's output so that both ZeRO 1-2 and ZeRO-3 engines load it.

    DeepSpeed writes the universal layout in the dialect of the stage that saved it, and its
    loaders read only their own: the model-states file name (ZeRO-3 looks for
    zero_pp_rank_0_mp_rank_XX_model_states.pt, ZeRO 1-2 for mp_rank_XX_model_states.pt; under
    load_universal only its metadata is read, the weights come from zero/), where Adam's step
    count lives (per parameter in step.pt for ZeRO 1-2, in optimizer_state.pt's
    optimizer_state_dict for ZeRO-3), ds_version, which the ZeRO 1-2 loader requires, and the
    per-parameter files (ZeRO-3 writes bare flat tensors, the ZeRO 1-2 loader reads
    {"param": tensor, "cat_dim": 0} and the ZeRO-3 loader reads both).
    """
    for plain in folder.glob("mp_rank_*_model_states.pt"):
        if not (folder / f"zero_pp_rank_0_{plain.name}").exists():
            shutil.copy2(plain, folder / f"zero_pp_rank_0_{plain.name}")
    for zero3 in folder.glob("zero_pp_rank_0_mp_rank_*_model_states.pt"):
        if not (folder / zero3.name[len("zero_pp_rank_0_"):]).exists():
            shutil.copy2(zero3, folder / zero3.name[len("zero_pp_rank_0_"):])
    import deepspeed
    from deepspeed.checkpoint.constants import CAT_DIM, PARAM

    state_path = folder / "zero" / "optimizer_state.pt"
    state = load_torch_file(state_path)
    param_dirs = [d for d in (folder / "zero").iterdir() if (d / "fp32.pt").is_file()]
    step = _adam_step(state, param_dirs)
    state.setdefault("ds_version", deepspeed.__version__)
    state.setdefault("optimizer_state_dict", {"state": {0: {"step": step}}, "param_groups": state["param_groups"]})
    torch.save(state, state_path)
    for param_dir in param_dirs:
        if not (param_dir / "step.pt").is_file():
            torch.save(step, param_dir / "step.pt")
        for name in ("fp32", "exp_avg", "exp_avg_sq"):
            path = param_dir / f"{name}.pt"
            tensor = load_torch_file(path) if path.is_file() else None
            if torch.is_tensor(tensor):
                torch.save({PARAM: tensor, CAT_DIM: 0}, path)


def _adam_step(state: dict, param_dirs: list[Path]) -> Any:
    """The optimizer's step count, from whichever place the saving stage put it."""
    if "optimizer_state_dict" in state:
        return state["optimizer_state_dict"]["state"][0]["step"]
    steps = [load_torch_file(d / "step.pt") for d in param_dirs if (d / "step.pt").is_file()]
    assert steps, "ds_to_universal wrote no step.pt for a ZeRO 1-2 checkpoint"
    return steps[0]


def _tmp_dir(ckpt_dir: Path, tag: str) -> Path:
    return ckpt_dir / f".{tag}{SUFFIX}.tmp"


def _remove_orphans(ckpt_dir: Path) -> None:
    """Universal copies whose source checkpoint was pruned are never loaded again."""
    for path in ckpt_dir.glob(f"step_*{SUFFIX}"):
        if not (ckpt_dir / path.name[:-len(SUFFIX)]).is_dir():
            shutil.rmtree(path, ignore_errors=True)
