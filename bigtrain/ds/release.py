"""Giving a throw-away DeepSpeed engine's memory back before the next one is built (the micro-batch probe's
engines, the frozen copy that precomputes a reference's log-probabilities)."""
from __future__ import annotations

import gc
from typing import Any

from deepspeed.accelerator import get_accelerator


def release_engine(engine: Any) -> None:
    """Remove the engine's hooks and its module from DeepSpeed's own registries, then collect.

    DeepSpeed's ZeRO-3 pushes every engine's module on a module-level stack (parameter_offload.FWD_MODULE_STACK)
    that `destroy` leaves as it is (DeepSpeed 0.19.8): without taking it off, the module and its partitions stay
    alive for the rest of the process."""
    from deepspeed.runtime.zero import parameter_offload
    module = getattr(engine, "module", None)
    engine.destroy()
    stack = getattr(parameter_offload, "FWD_MODULE_STACK", [])
    stack[:] = [m for m in stack if m is not module]
    del engine, module
    gc.collect()
    get_accelerator().empty_cache()
