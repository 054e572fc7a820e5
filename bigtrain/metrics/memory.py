"""Per-rank memory: model-state bytes counted from the tensors, and the peak the process reached.

Model states are counted from the tensors themselves, never from the allocator, because
DeepSpeed's CPU accelerator reports process RSS as "device memory". The ZeRO optimizers
keep their partitions in their own attributes (read from DeepSpeed 0.19's
`runtime/zero/stage_1_and_2.py`, `stage3.py`, `fp16/*` and `bf16_optimizer.py`); each
storage is counted once, in the first category that names it, so a parameter that is a
view into a flat buffer is not counted twice.
"""
from __future__ import annotations

import resource
import sys
from typing import Any, Iterable, Iterator

import torch
from deepspeed.accelerator import get_accelerator

# Attributes of DeepSpeed's optimizer wrappers, by what they hold. Missing ones are skipped.
PARAM_ATTRS = ("bit16_groups_flat", "fp16_partitioned_groups_flat", "bf16_groups_flat", "fp16_groups_flat",
               "lp_param_buffer", "param_groups_fp16_flat_cpu_memory", "param_buffer_of_bit16_for_cpu_offload_groups")
GRAD_ATTRS = ("averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer", "fp32_groups_gradients_flat",
              "fp32_groups_gradient_flat_partition", "accumulated_grads_in_cpu", "temp_grad_buffer_for_cpu_offload",
              "temp_grad_buffer_for_gpu_offload")
MASTER_ATTRS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat",
                "fp32_groups_flat_partition", "fp32_groups")
BUFFER_ATTRS = ("ipg_buckets",)

# Counting order: a gradient that is a view into a bucket is the bucket's (buffers before grads).
CATEGORIES = ("params", "live_params", "buffers", "grads", "optimizer")


def _tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors inside nested lists / tuples / dicts / bucket objects (not their .grad)."""
    if depth > 4 or obj is None:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item, depth + 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item, depth + 1)
    elif hasattr(obj, "buffer"):  # DeepSpeed's IPGBucket: .buffer is a tensor or a list of them
        yield from _tensors(obj.buffer, depth + 1)


def _param_tensors(params: Iterable[torch.nn.Parameter]) -> dict[str, list[torch.Tensor]]:
    found: dict[str, list[torch.Tensor]] = {"params": [], "live_params": [], "grads": []}
    for p in params:
        if hasattr(p, "ds_tensor"):
            # ZeRO-3: ds_tensor is this rank's partition. p.data is empty unless the parameter
            # is gathered for a forward/backward ("live"), or small enough to persist whole.
            found["params"].append(p.ds_tensor)
            found["params" if getattr(p, "ds_persist", False) else "live_params"].append(p.data)
        else:
            found["params"].append(p.data)
        # ZeRO-1 accumulating 16-bit gradients in fp32 keeps them in `grad_accum` beside `.grad`.
        found["grads"].extend(g for g in (p.grad, getattr(p, "grad_accum", None)) if isinstance(g, torch.Tensor))
    return found


def _optimizer_tensors(optimizer: Any) -> dict[str, list[torch.Tensor]]:
    found: dict[str, list[torch.Tensor]] = {c: [] for c in CATEGORIES}
    if optimizer is None:
        return found
    for category, attrs in (("params", PARAM_ATTRS), ("grads", GRAD_ATTRS), ("optimizer", MASTER_ATTRS),
                            ("buffers", BUFFER_ATTRS)):
        for attr in attrs:
            tensors = list(_tensors(getattr(optimizer, attr, None)))
            found[category].extend(tensors)
            # The fp32 gradient DeepSpeed hangs on a master partition for the step is a gradient.
            found["grads"].extend(t.grad for t in tensors if t.grad is not None)
    # A ZeRO / fp16 wrapper holds the torch optimizer in `.optimizer`; a bare torch optimizer is its own.
    inner = optimizer if isinstance(optimizer, torch.optim.Optimizer) else getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        found["optimizer"].extend(_tensors(list(inner.state.values())))
        for group in inner.param_groups:  # master weights the wrapper handed to the torch optimizer
            masters = list(_tensors(group["params"]))
            found["optimizer"].extend(masters)
            found["grads"].extend(t.grad for t in masters if t.grad is not None)
    return found


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # the StorageImpl: shared by every view of one allocation


def memory_report(model_or_engine: Any, optimizer: Any = None) -> dict[str, int]:
    """Model-state bytes of this rank, counted from the tensors, per category and in total.

    `model_or_engine` is a DeepSpeed engine (its module and optimizer are used), an
    nn.Module, or an iterable of parameters; `optimizer` is the torch optimizer or
    DeepSpeed's wrapper (`engine.optimizer`). Keys: params_bytes (ZeRO-3: the partition
    and the persistent small parameters), live_params_bytes (ZeRO-3 parameters gathered
    right now), grads_bytes, optimizer_bytes (states and fp32 master copies),
    buffers_bytes (DeepSpeed's gradient buckets), model_state_bytes (params + grads +
    optimizer), and host_bytes: the part of all of these in host memory while the
    accelerator is not the CPU (offload).
    """
    if hasattr(model_or_engine, "module") and hasattr(model_or_engine, "optimizer") and optimizer is None:
        optimizer = model_or_engine.optimizer
        model_or_engine = model_or_engine.module
    params = model_or_engine.parameters() if isinstance(model_or_engine, torch.nn.Module) else model_or_engine
    from_params = _param_tensors(params)
    found = _optimizer_tensors(optimizer)
    for category, tensors in from_params.items():
        found[category] = tensors + found[category]
    accel_on_cpu = get_accelerator().device_name() == "cpu"
    seen: set[int] = set()
    report = {f"{c}_bytes": 0 for c in CATEGORIES}
    report["host_bytes"] = 0
    for category in CATEGORIES:
        for t in found[category]:
            if t.device.type == "meta" or t.numel() == 0:
                continue
            key = _storage_key(t)
            if key in seen:
                continue
            seen.add(key)
            nbytes = t.untyped_storage().nbytes()
            report[f"{category}_bytes"] += nbytes
            if t.device.type == "cpu" and not accel_on_cpu:
                report["host_bytes"] += nbytes
    report["model_state_bytes"] = report["params_bytes"] + report["grads_bytes"] + report["optimizer_bytes"]
    return report


def rss_bytes() -> int:
    """Current resident set size of this process."""
    import psutil
    return psutil.Process().memory_info().rss


def _vm_hwm_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """Highest resident set size of this process since start or `reset_peak_memory()`.

    Linux: VmHWM from /proc/self/status (resettable); elsewhere ru_maxrss. The kernel updates
    the high-water mark lazily, so it can trail the current RSS by a few pages: take the larger.
    """
    peak = _vm_hwm_bytes()
    if peak is None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = peak if sys.platform == "darwin" else peak * 1024
    return max(peak, rss_bytes())


def peak_memory() -> dict[str, int]:
    """This rank's peak memory, named for what it is.

    On an accelerator: peak_device_bytes / device_bytes (allocated by torch on the device)
    plus the host's peak_rss_bytes. On CPU only peak_rss_bytes / rss_bytes exist: the CPU
    accelerator's "device memory" is the process RSS, which includes the interpreter and
    libraries, so it is not comparable to a device figure.
    """
    acc = get_accelerator()
    report = {"peak_rss_bytes": peak_rss_bytes(), "rss_bytes": rss_bytes()}
    if acc.device_name() != "cpu":
        report["peak_device_bytes"] = int(acc.max_memory_allocated())
        report["device_bytes"] = int(acc.memory_allocated())
    return report


def reset_peak_memory() -> None:
    """Restart the peak counters: the device's, and on Linux the peak RSS (VmHWM, via /proc/self/clear_refs)."""
    acc = get_accelerator()
    if acc.device_name() != "cpu":
        acc.reset_peak_memory_stats()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux >= 4.0: resets VmHWM to the current RSS
    except OSError:
        pass  # not Linux: ru_maxrss cannot be reset; compare against a baseline instead


def memory_per_rank_bytes(peak: dict[str, int]) -> int:
    """The one number a log line shows: device peak where there is a device, else peak RSS."""
    return peak.get("peak_device_bytes", peak["peak_rss_bytes"])
