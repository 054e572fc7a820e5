"""Loading a checkpoint never runs code from it (unless the user says they trust it).

`torch.load` unpickles, and a pickle can call any function it names: a checkpoint someone sent
you could run whatever it holds when you resume or export it. DeepSpeed 0.19.8 loads its own
files with `weights_only=False` (TorchCheckpointEngine.load, the universal-checkpoint loaders,
ds_to_universal, zero_to_fp32). So, while bigtrain loads a checkpoint (`checkpoint_loading`):

- every `*.pt` file of the checkpoint is scanned first for pickled globals outside the
  allow-list, and the first one is refused with one line naming the file and the type;
- every `torch.load` in the process, DeepSpeed's included, is forced to `weights_only=True`
  (torch's TORCH_FORCE_WEIGHTS_ONLY_LOAD), which rebuilds only tensors, plain containers and
  the allow-listed types; an unpickling error there is the same one-line refusal.

The allow-list is what DeepSpeed 0.19.8 pickles besides tensors and containers, read from real
checkpoints of ZeRO 0-3, bf16, CPU offload of optimizer and parameters, pipelines and universal
conversions (`torch.serialization.get_unsafe_globals_in_checkpoint`): the loss scaler, the ZeRO
stage enum and the tensor-fragment address of its optimizer files. None of them runs code when
rebuilt (plain attribute objects, an enum, a dataclass). Version-1 RNG files (`rng_rank*.pt`)
also hold numpy's RNG state as an array; numpy's array types are allowed for those files only.
`trust=True` (`--trust-checkpoint`) loads as DeepSpeed does, with no checks.
"""
from __future__ import annotations

import contextlib
import functools
import os
import pickle
import re
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Iterator

import torch

FORCE = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
FORCE_NOT = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"
RNG_FILES = "rng_rank*.pt"
_trusted: ContextVar[bool] = ContextVar("bigtrain_trust_checkpoint", default=False)


class UnsafeCheckpoint(ValueError):
    """A checkpoint file needs a type outside the allow-list: refused, with the fix."""

    def __init__(self, where: str | Path, type_name: str):
        self.type_name = type_name
        super().__init__(f"{where} needs {type_name} to load, which is not a type DeepSpeed or bigtrain writes "
                         "(unpickling it could run code from the file); refused. Pass --trust-checkpoint if "
                         "you trust whoever wrote this checkpoint")


@functools.lru_cache(maxsize=1)
def allowed_globals() -> tuple[Any, ...]:
    """The types DeepSpeed 0.19.8 pickles into its checkpoint files (see the module docstring)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return (LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address)


@functools.lru_cache(maxsize=1)
def rng_v1_globals() -> tuple[Any, ...]:
    """numpy's array, as `np.random.get_state()` in a version-1 RNG file pickles it (numpy 1 and 2 names)."""
    import numpy as np
    reconstruct = np._core.multiarray._reconstruct if hasattr(np, "_core") else np.core.multiarray._reconstruct
    return (np.ndarray, np.dtype, type(np.dtype(np.uint32)), (reconstruct, "numpy._core.multiarray._reconstruct"),
            (reconstruct, "numpy.core.multiarray._reconstruct"))


def trusted() -> bool:
    """Inside `checkpoint_loading(..., trust=True)`."""
    return _trusted.get()


@contextlib.contextmanager
def checkpoint_loading(folder: str | Path, trust: bool = False) -> Iterator[None]:
    """Load the checkpoint in `folder` (DeepSpeed's loaders, export, conversion) inside this block.

    Not trusted: refuse a file with a type outside the allow-list before anything is loaded, then
    force every torch.load in the block to weights_only=True. Trusted: no checks.
    """
    token = _trusted.set(trust)
    try:
        if trust:
            yield
            return
        refuse_unsafe_files(Path(folder))
        with _forced_weights_only(), _allowing(allowed_globals()):
            try:
                yield
            except pickle.UnpicklingError as err:
                raise UnsafeCheckpoint(f"a file of checkpoint {folder}", _type_in(err)) from None
    finally:
        _trusted.reset(token)


def load_torch_file(path: str | Path, trust: bool | None = None, **kwargs: Any) -> Any:
    """`torch.load` for bigtrain's own reads of checkpoint files: weights only with the allow-list,
    unless `trust`, or (`trust=None`) inside `checkpoint_loading(..., trust=True)`."""
    if trust or (trust is None and trusted()):
        return torch.load(path, weights_only=False, **kwargs)
    extra = rng_v1_globals() if Path(path).match(RNG_FILES) else ()
    with _allowing((*allowed_globals(), *extra)):
        try:
            return torch.load(path, weights_only=True, **kwargs)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpoint(path, _type_in(err)) from None


def refuse_unsafe_files(folder: Path) -> None:
    """UnsafeCheckpoint for the first `*.pt` file under `folder` that pickles a type outside the allow-list.

    A static scan of each file's pickle (its tensors are not read). A file torch cannot scan (not
    a zip archive) is left to the forced weights-only load, which refuses the same types.
    """
    allowed = {_name(g) for g in allowed_globals()}
    rng_allowed = allowed | {_name(g) for g in rng_v1_globals()}
    for path in sorted(folder.rglob("*.pt")):
        try:
            found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except (ValueError, RuntimeError, KeyError, OSError):
            continue
        unsafe = sorted(set(found) - (rng_allowed if path.match(RNG_FILES) else allowed))
        if unsafe:
            raise UnsafeCheckpoint(path, unsafe[0])


@contextlib.contextmanager
def _forced_weights_only() -> Iterator[None]:
    """Every torch.load weights-only, whatever its caller passes (torch reads the variable per call)."""
    saved = {key: os.environ.get(key) for key in (FORCE, FORCE_NOT)}
    os.environ[FORCE] = "1"
    os.environ.pop(FORCE_NOT, None)  # both set is an error in torch
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _allowing(entries: tuple[Any, ...]) -> Iterator[None]:
    """Add `entries` to torch's process-wide safe globals for the block, then put the list back as it
    was (torch's own `safe_globals` context removes its entries on exit even when an enclosing block
    added them too, which would break that block)."""
    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals(list(entries))
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


def _name(entry: Any) -> str:
    if isinstance(entry, tuple):
        return entry[1]
    return f"{entry.__module__}.{entry.__qualname__}"


_TYPE_PATTERNS = [re.compile(p, re.MULTILINE) for p in (
    r"GLOBAL (\S+) was not an allowed global", r"unsupported GLOBAL (\S+) whose module",
    r"unrecognized function (.+?)(?: which belongs|$)", r"allowlisted via `add_safe_globals`,? but got (.+?)$",
    r"(Unsupported operand \S+)")]


def _type_in(err: Exception) -> str:
    """The type (or pickle opcode) a weights-only unpickling error names."""
    text = str(err)
    for pattern in _TYPE_PATTERNS:
        found = pattern.search(text)
        if found:
            name = found.group(1).strip().rstrip(".")
            return f"builtins.{name}" if pattern is _TYPE_PATTERNS[0] and "." not in name else name  # torch drops it
    return text.strip().splitlines()[-1][:200] if text.strip() else type(err).__name__
