"""What a DeepSpeed config may hold, read from the installed DeepSpeed at run time.

No key list here is copied by hand from DeepSpeed's documentation, so a DeepSpeed upgrade cannot
leave the lint stale. Instead DeepSpeed's own parser is asked:

- `probe(path)` runs `deepspeed.runtime.config.DeepSpeedConfig` on a tiny config whose dicts
  record every key DeepSpeed reads from them (`get`, `[]`, `in`) and the default it reads it
  with (which gives the value's type); a sentinel key placed at `path` shows which of
  DeepSpeed's pydantic models (`DeepSpeedConfigModel` subclasses: ZeRO, offload, fp16/bf16,
  monitors, comms, compile, timers, tensor parallel...) validates that section, if any.
- `removed_keys()` is DeepSpeed's own table of the features it dropped (it refuses those keys).
- Optimizer and scheduler names come from `DEEPSPEED_OPTIMIZERS`, `torch.optim` and
  `deepspeed.runtime.lr_schedules` / `torch.optim.lr_scheduler`, the way the engine looks them up.
- `hf_auto_keys()` reads which keys the Hugging Face integration fills when they say "auto"
  from the installed transformers and accelerate sources.

What DeepSpeed reads outside its config parser is listed in OUTSIDE_PARSER (a test checks that
each entry still occurs in DeepSpeed's source).
"""
from __future__ import annotations

import functools
import inspect
import re
import threading
from dataclasses import dataclass, field
from typing import Any

SENTINEL = "__bigtrain_probe__"
NO_DEFAULT = object()  # read with `in` or `[]`: no default, no type to check against

# Keys DeepSpeed reads outside DeepSpeedConfig: deepspeed.initialize builds a device mesh from the
# first two, PipelineEngine reads `pipeline.use_reentrant` (the parser copies `pipeline` whole).
OUTSIDE_PARSER: dict[tuple[str, ...], type] = {
    ("data_parallel_size",): int,
    ("sequence_parallel_size",): int,
    ("pipeline", "use_reentrant"): bool,
}
# Keys bigtrain adds to a DeepSpeed dict for its own use (none today; DeepSpeed must be able to read every
# key bigtrain writes, and `ds_configs/*.json` lint clean).
BIGTRAIN_KEYS: dict[tuple[str, ...], type] = {}
# Used when transformers/accelerate are not installed: the keys their DeepSpeed integration fills.
HF_AUTO_FALLBACK = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
    "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps", "optimizer.params.weight_decay",
    "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps",
    "scheduler.params.total_num_steps", "fp16.enabled", "bf16.enabled", "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_param_persistence_threshold",
    "zero_optimization.stage", "zero_optimization.offload_optimizer.device",
    "zero_optimization.offload_param.device", "zero_optimization.offload_optimizer.nvme_path",
    "zero_optimization.offload_param.nvme_path", "zero_optimization.stage3_gather_16bit_weights_on_model_save",
})


@dataclass
class Probe:
    """What DeepSpeed's parser did with the dict at one key path."""

    reads: dict[str, Any] = field(default_factory=dict)  # key -> the default DeepSpeed reads it with
    iterated: bool = False  # DeepSpeed copied the whole dict (any key is taken)
    model: Any = None  # the pydantic model that validates this dict, if any


class _Recorder(dict):
    """A dict that notes which keys DeepSpeed asks it for."""

    def __init__(self, data: dict, path: tuple[str, ...], log: dict):
        super().__init__(data)
        self._path, self._log = path, log

    def _note(self, key: Any, default: Any = NO_DEFAULT) -> None:
        reads = self._log.setdefault(self._path, Probe()).reads
        if reads.get(key, NO_DEFAULT) is NO_DEFAULT:
            reads[key] = default

    def get(self, key, default=None):
        self._note(key, default)
        return super().get(key, default)

    def __getitem__(self, key):
        self._note(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self._note(key)
        return super().__contains__(key)

    def keys(self):
        return _RecordedKeys(self)

    def __iter__(self):
        self._log.setdefault(self._path, Probe()).iterated = True
        return super().__iter__()

    def items(self):
        self._log.setdefault(self._path, Probe()).iterated = True
        return super().items()


class _RecordedKeys:
    """`key in d.keys()` is a read of one key, not of all of them."""

    def __init__(self, owner: _Recorder):
        self.owner = owner

    def __contains__(self, key) -> bool:
        return key in self.owner

    def __iter__(self):
        return iter(self.owner)

    def __len__(self) -> int:
        return dict.__len__(self.owner)


def _wrap(value: Any, path: tuple[str, ...], log: dict) -> Any:
    if isinstance(value, dict):
        return _Recorder({k: _wrap(v, path + (k,), log) for k, v in value.items()}, path, log)
    return value


class _OneWorld:
    """An mpu stand-in so the parser needs no process group."""

    def get_data_parallel_world_size(self) -> int:
        return 1

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1


class _FixedWorld(_OneWorld):
    """An mpu stand-in: DeepSpeedConfig checks the batch triple at this data-parallel size."""

    def __init__(self, dp: int):
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp


# Held while DeepSpeed's config module is patched: two threads linting at once (Tune's trials) would otherwise
# restore each other's patch and leave it in place for good.
_PATCHING = threading.RLock()


def parser_refusal(config: dict, dp: int) -> str | None:
    """DeepSpeed's DeepSpeedConfig on `config` at data-parallel size `dp`: its first complaint, or None."""
    from unittest import mock

    from deepspeed.runtime import config as ds_config
    try:
        # With no process group DeepSpeedConfig falls back to world size 1 before it asks the mpu;
        # answering rank 0 makes it take the data-parallel size from the stand-in.
        with _PATCHING, mock.patch.object(ds_config.dist, "get_rank", return_value=0):
            ds_config.DeepSpeedConfig(config, mpu=_FixedWorld(dp))
    except BaseException as err:  # noqa: BLE001 - DeepSpeed asserts, raises ValueError/ValidationError
        return next((ln.strip() for ln in str(err).splitlines() if ln.strip()), type(err).__name__)
    return None


@functools.lru_cache(maxsize=None)
def probe(path: tuple[str, ...] = ()) -> Probe:
    """Run DeepSpeed's parser with a sentinel dict at `path`; what did it read there, with which model?"""
    from deepspeed.runtime import config as ds_config
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel
    result = Probe()
    for body in ({SENTINEL: 1, "enabled": True, "type": SENTINEL}, {SENTINEL: 1}):
        config: dict = {"train_micro_batch_size_per_gpu": 1}
        if path:
            node = config
            for key in path[:-1]:  # sections read only when enabled: enable the parents too
                node = node.setdefault(key, {"enabled": True} if len(body) > 1 else {})
            node[path[-1]] = dict(body)
        log: dict = {}
        built: list = []

        def spy(self, strict=False, **data):
            built.append((type(self), data))
            return original(self, strict=strict, **data)

        with _PATCHING:
            original = DeepSpeedConfigModel.__init__
            DeepSpeedConfigModel.__init__ = spy
            try:
                ds_config.DeepSpeedConfig(_wrap(config, (), log), mpu=_OneWorld())
            except BaseException:  # noqa: BLE001 - the reads before the failure are what we want
                pass
            finally:
                DeepSpeedConfigModel.__init__ = original
        found = log.get(path, Probe())
        for key, default in found.reads.items():
            if key != SENTINEL and result.reads.get(key, NO_DEFAULT) is NO_DEFAULT:
                result.reads[key] = default
        result.iterated |= found.iterated
        result.model = result.model or next((cls for cls, data in built if data.get(SENTINEL) == 1), None)
    return result


@functools.lru_cache(maxsize=None)
def top_level() -> dict[str, Any]:
    """Every top-level key DeepSpeed reads (-> its default), without the removed features."""
    reads = dict(probe(()).reads)
    for key, kind in OUTSIDE_PARSER.items():
        if len(key) == 1:
            reads.setdefault(key[0], kind())
    for key, kind in BIGTRAIN_KEYS.items():
        if len(key) == 1:
            reads.setdefault(key[0], kind())
    removed = removed_keys(())
    return {k: v for k, v in reads.items() if k not in removed}


def section_keys(path: tuple[str, ...]) -> dict[str, Any] | None:
    """Keys DeepSpeed reads in the dict section at `path` (-> default); None when it takes any key."""
    found = probe(path)
    if found.iterated:
        return None
    keys = dict(found.reads)
    for extra in (OUTSIDE_PARSER, BIGTRAIN_KEYS):
        for key, kind in extra.items():
            if key[:-1] == path:
                keys.setdefault(key[-1], kind())
    return keys


def open_section_known(path: tuple[str, ...]) -> set[str]:
    """For a section DeepSpeed copies whole (`pipeline`): the keys its defaults and readers name."""
    known = {key[-1] for key in (*OUTSIDE_PARSER, *BIGTRAIN_KEYS) if key[:-1] == path}
    if path == ("pipeline",):
        from deepspeed.runtime.config import get_pipeline_config
        known |= set(get_pipeline_config({}))
    return known


def removed_keys(path: tuple[str, ...]) -> dict[str, str]:
    """DeepSpeed's own table of removed features at `path` -> its message (it refuses these keys)."""
    from deepspeed.runtime import config as ds_config
    tables = {(): "_REMOVED_TOP_LEVEL_CONFIG_KEYS", ("zero_optimization",): "_REMOVED_ZERO_CONFIG_KEYS"}
    return dict(getattr(ds_config, tables[path], {})) if path in tables else {}


def model_fields(model: Any) -> dict[str, Any]:
    """Accepted keys of a pydantic model (field names and aliases) -> the nested model or None."""
    keys: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        nested = _nested_model(info.annotation)
        keys[name] = nested
        if info.alias:
            keys[info.alias] = nested
    return keys


def model_default(path: tuple[str, ...]) -> tuple[Any, Any]:
    """(model, default) for the field at `path` inside a section one of DeepSpeed's pydantic models validates;
    (None, NO_DEFAULT) where none does. DeepSpeedConfigModel drops "auto" before it validates, so "auto" at such
    a field means the field's default (DeepSpeed's config_utils: the HF models' "auto" left to it)."""
    for cut in range(1, len(path)):
        model = probe(path[:cut]).model
        for part in path[cut:-1]:
            model = model_fields(model).get(part) if model is not None else None
        if model is None:
            continue
        for name, info in model.model_fields.items():
            if path[-1] in (name, info.alias):
                default = info.get_default(call_default_factory=True)
                return model, int(default) if isinstance(default, int) and not isinstance(default, bool) else default
    return None, NO_DEFAULT


def _nested_model(annotation: Any) -> Any:
    for candidate in (annotation, *getattr(annotation, "__args__", ())):
        if inspect.isclass(candidate) and hasattr(candidate, "model_fields"):
            return candidate
    return None


# --- optimizers and schedulers, looked up the way DeepSpeedEngine does ------------------------------

def deepspeed_optimizers() -> list[str]:
    """DeepSpeed's own optimizer names; `optimizer.type` matches them in any case."""
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
    return list(DEEPSPEED_OPTIMIZERS)


def torch_optimizers() -> list[str]:
    """torch.optim classes; DeepSpeed takes these by exact name (`getattr(torch.optim, type)`)."""
    import torch
    return sorted(n for n, c in vars(torch.optim).items()
                  if inspect.isclass(c) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer)


def optimizer_class(name: str, params: dict, cpu_offload: bool) -> Any:
    """The class DeepSpeed would build for `optimizer.type` (None: it has none of that name)."""
    import torch
    lowered = name.lower()
    if lowered in ("adam", "adamw"):
        if params.get("torch_adam"):
            return torch.optim.AdamW if lowered == "adamw" or params.get("adam_w_mode", True) else torch.optim.Adam
        if cpu_offload:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            return DeepSpeedCPUAdam
        from deepspeed.ops.adam import FusedAdam
        return FusedAdam
    if lowered == "lamb":
        from deepspeed.ops.lamb import FusedLamb
        return FusedLamb
    if lowered == "lion":
        from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion
        return DeepSpeedCPULion if cpu_offload else FusedLion
    if lowered == "adagrad":
        if cpu_offload:
            from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
            return DeepSpeedCPUAdagrad
        return torch.optim.Adagrad
    if lowered in deepspeed_optimizers():
        return lowered  # muadam/musgd/muon...: built from other packages; accepted by name
    return getattr(torch.optim, name, None)


# Parameters DeepSpeed pops from `optimizer.params` before it builds an Adam-family optimizer.
ADAM_POPPED = ("torch_adam", "adam_w_mode", "fp32_optimizer_states")


def scheduler_class(name: str) -> Any:
    """DeepSpeed's scheduler `name` (its lr_schedules, else torch.optim.lr_scheduler; exact case)."""
    import torch
    from deepspeed.runtime import lr_schedules
    return getattr(lr_schedules, name, None) or getattr(torch.optim.lr_scheduler, name, None)


def scheduler_names() -> list[str]:
    from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES
    return list(VALID_LR_SCHEDULES)


# --- "auto": where DeepSpeed or the Hugging Face integration accepts it -----------------------------

@functools.lru_cache(maxsize=None)
def hf_auto_keys() -> frozenset[str]:
    """Dotted keys the HF Trainer (transformers) and accelerate fill when the JSON says "auto".

    Read from their installed sources, not imported (seconds): every `fill_match("...")` /
    `fill_only("...")` of transformers' HfTrainerDeepSpeedConfig, the DeepSpeed keys of accelerate's
    DeepSpeedPlugin mapping and the keys accelerate fills in `_prepare_deepspeed`. DeepSpeed itself
    drops "auto" inside its pydantic models (a field left at its default), which `lint` learns by
    validating with those models.
    """
    keys = set(re.findall(r'fill_(?:match|only)\(\s*"([\w.]+)"', _source("transformers", "integrations/deepspeed.py")))
    mapping = re.search(r"plugin_to_config_mapping = \{(.*?)\}", _source("accelerate", "utils/dataclasses.py"), re.S)
    if mapping:
        keys |= set(re.findall(r':\s*"([\w.]+)"', mapping.group(1)))
    prepare = _source("accelerate", "accelerator.py")
    for block in re.findall(r"config_kwargs = \{(.*?)\}", prepare, re.S):
        keys |= set(re.findall(r'"([\w.]+)":', block))
    keys |= set(re.findall(r'config_kwargs\["([\w.]+)"\]', prepare))
    return frozenset(keys) if len(keys) >= 10 else HF_AUTO_FALLBACK


def _source(package: str, relative: str) -> str:
    """The text of one file of an installed package ("" when it is not there)."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return ""
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    return path.read_text() if path.is_file() else ""
