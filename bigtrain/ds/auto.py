"""HF-style "auto" in a user's DeepSpeed JSON, resolved the way DeepSpeed and the HF integration read it.

Who decides each "auto", in order:

1. bigtrain's run config, where the generated dict has the key (under DeepSpeed's old name too:
   `bfloat16` is the `bf16` section DeepSpeed reads when `bf16` is absent);
2. the HF Trainer / accelerate keys bigtrain has no setting for: left to DeepSpeed's default;
3. any other field of a section one of DeepSpeed's pydantic models validates: `DeepSpeedConfigModel`
   drops "auto" before validating, so the field's default applies (`offload_param.buffer_size`,
   `prefetch_bucket_size` without its `stage3_` prefix, which the HF Trainer does not fill).

Each of 2 and 3 removes the key (what DeepSpeed would do) and says so in one line. An "auto" DeepSpeed
would keep as a string is the lint's to refuse (`bigtrain.ds.lint`), before this runs.
"""
from __future__ import annotations

from typing import Any, Iterator

from bigtrain.config.run_config import RunConfig
from bigtrain.ds.lint import BATCH_KEYS, LintError
from bigtrain.ds.lint.checks import show
from bigtrain.ds.mapping import MISSING, get_path, set_path

# A section's old name DeepSpeed still reads -> the name bigtrain generates.
OLD_NAMES = {"bfloat16": "bf16"}


def resolve_auto(config: dict, generated: dict, run: RunConfig, notes: list[str]) -> None:
    """Replace or remove every "auto" in `config` (in place) except the batch keys, one note per choice
    that is not plainly the run config's value."""
    from bigtrain.ds.lint import schema
    extra = {("zero_optimization", "offload_optimizer", "device"): run.offload.optimizer,
             ("zero_optimization", "offload_param", "device"): run.offload.param,
             ("zero_optimization", "offload_optimizer", "nvme_path"): run.offload.nvme_path,
             ("zero_optimization", "offload_param", "nvme_path"): run.offload.nvme_path}
    left = []
    for path in list(auto_paths(config)):
        if path[0] in BATCH_KEYS:
            continue  # the batch solver decides these
        dotted = ".".join(path)
        value, old = get_path(generated, path), OLD_NAMES.get(path[0])
        if value is MISSING and old and old not in config:  # DeepSpeed reads the old name only without the new
            value = get_path(generated, (old, *path[1:]))
            if value is not MISSING:
                notes.append(f"{dotted}=\"auto\": {path[0]} is DeepSpeed's old name for {old}; took the run config's "
                             f"value ({show(value)}). The HF Trainer fills only {old}.{path[-1]}: under it DeepSpeed "
                             f"drops this \"auto\" and its default applies")
        if value is MISSING and path in extra:
            value = extra[path]
        if value is not MISSING:
            set_path(config, path, value)
            continue
        model, default = schema.model_default(path)
        if dotted in schema.hf_auto_keys():
            set_path(config, path, MISSING)
            notes.append(f"{dotted}=\"auto\": bigtrain has no setting for it; DeepSpeed's default applies")
        elif model is not None:
            set_path(config, path, MISSING)
            notes.append(f"{dotted}=\"auto\": DeepSpeed's {model.__name__} drops \"auto\" here: its default "
                         f"{show(default)} applies")
        else:
            left.append(dotted)
    if left:  # the lint refuses these first; kept so that no "auto" ever reaches DeepSpeed as a string
        raise LintError([f"{p}=\"auto\": neither bigtrain, the HF integration nor DeepSpeed fills this key; give it "
                         "a value" for p in left])


def auto_paths(node: Any, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Key paths whose value is "auto"."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from auto_paths(value, (*prefix, key))
    elif node == "auto":
        yield prefix

