"""What a resumed job must agree on with its checkpoint before anything is loaded: the model.

A checkpoint's marker records how its model was built (`ModelBuild`: family, size, overrides). A job
that asks for another model would either fail deep inside DeepSpeed's load with a `size mismatch`
traceback or, where the shapes happen to agree (another head count), load the weights into a different
model and train on silently. Both are refused here with one line naming what differs.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bigtrain.checkpoint.state import CheckpointState, ModelBuild

# The data's sequence length: it sizes batches and FLOPs, not the weights (positions are the model's
# n_positions / max_position_embeddings, which are compared).
NOT_THE_MODEL = {"seq_len"}
_ABSENT = object()


def check_same_model(tag_dir: Path, state: CheckpointState, wanted: ModelBuild) -> None:
    """ValueError (one line) when `wanted` is not the model the checkpoint in `tag_dir` trained."""
    if state.model_build is None:  # a marker from before bigtrain recorded the build: nothing to compare
        return
    differences = model_differences(state.model_build, wanted)
    if differences:
        shown = "; ".join(differences[:6]) + (f"; and {len(differences) - 6} more" if len(differences) > 6 else "")
        raise ValueError(f"--resume: {tag_dir} trained another model ({shown}): resume with the "
                         "model settings it was trained with, or start a new run with another --out (or "
                         "--overwrite to delete this run's checkpoints)")


def model_differences(saved: ModelBuild, wanted: ModelBuild) -> list[str]:
    """`what saved -> wanted` for each setting that differs: family, size, then every setting the two builds
    resolve to (the named size's settings under the overrides, compared as JSON, as the marker holds them)."""
    found = [f"model.{name} {a} -> {b}" for name, a, b in
             (("family", saved.family, wanted.family), ("size", saved.size, wanted.size)) if a != b]
    if saved.family != wanted.family:  # another family's settings are another vocabulary: the family says it
        return found
    before_all = _settings(saved)
    now = _settings(wanted)
    for key in sorted((set(before_all) | set(now)) - NOT_THE_MODEL):
        before, after = before_all.get(key, _ABSENT), now.get(key, _ABSENT)
        if before != after and not (key == "pretrained" and _same_directory_config(before, after)):
            found.append(f"{key} {_shown(before)} -> {_shown(after)}")
    return found


def _settings(build: ModelBuild) -> dict:
    from bigtrain.models.registry import size_settings
    try:
        named = size_settings(build.family, build.size)
    except (KeyError, ValueError):  # a family this bigtrain does not know: its overrides are all there is
        named = {}
    return json.loads(json.dumps({**named, **build.overrides}, default=str))


def _same_directory_config(before: Any, after: Any) -> bool:
    """Two pretrained directories with the same config.json build the same model (a copied directory); one that
    is gone since the save (moved) cannot be compared, and the weights come from the checkpoint anyway."""
    if not (isinstance(before, str) and isinstance(after, str)):
        return False
    saved, now = Path(before) / "config.json", Path(after) / "config.json"
    if not saved.is_file():
        return True
    return now.is_file() and json.loads(saved.read_text()) == json.loads(now.read_text())


def _shown(value: Any) -> str:
    return "(not set)" if value is _ABSENT else json.dumps(value)
