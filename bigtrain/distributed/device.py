"""Facts about this job's accelerator that choose defaults (precision)."""
from __future__ import annotations

import os
import re
from collections.abc import MutableMapping
from pathlib import Path


def cpu_has_amx() -> bool:
    """AMX tiles make bf16 matmuls several times faster than fp32 on a CPU; without them bf16 is slower."""
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def default_precision(device_name: str | None = None) -> str:
    """What `precision: auto` means here: bf16 on accelerators that have it (fp16 otherwise);
    on a CPU, bf16 only with AMX, else fp32 (measured here: bf16 matmul 0.05 vs fp32 0.14 TFLOP/s
    per core without AMX)."""
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    name = device_name or acc.device_name()
    if name == "cpu":
        return "bf16" if cpu_has_amx() else "fp32"
    return "bf16" if acc.is_bf16_supported() else "fp16"


def deepspeed_arch_list(value: str) -> str | None:
    """`TORCH_CUDA_ARCH_LIST` as DeepSpeed's JIT op builder can read it, or None when it already can.

    DeepSpeed 0.19's builder parses each entry as MAJOR.MINOR[+PTX] and fails on the arch-specific
    suffix NVIDIA's CUDA images set (`9.0a`: "invalid literal for int() with base 10: '0a'") before
    it builds FusedAdam. Its ops use no arch-specific instructions, so `9.0a` becomes `9.0`.
    """
    entries = [e for e in value.replace(";", " ").split() if e]
    fixed = [re.sub(r"^(\d+)\.(\d+)[a-z]+", r"\1.\2", e) for e in entries]
    return ";".join(dict.fromkeys(fixed)) if fixed != entries else None


def fix_cuda_arch_list(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Rewrite an unreadable `TORCH_CUDA_ARCH_LIST` in `environ` (default: this process's); returns a
    line saying what changed, or None."""
    environ = os.environ if environ is None else environ
    old = environ.get("TORCH_CUDA_ARCH_LIST", "")
    new = deepspeed_arch_list(old)
    if new is None:
        return None
    environ["TORCH_CUDA_ARCH_LIST"] = new
    return f"TORCH_CUDA_ARCH_LIST={old!r} -> {new!r}: DeepSpeed's op builder cannot parse arch suffixes"
