"""Facts about this job's accelerator that choose defaults (precision)."""
from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping
from pathlib import Path


def cpu_flags() -> set[str]:
    """The CPU's instruction-set extensions as Linux lists them (x86 `flags`, ARM `Features`); empty elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_has_amx() -> bool:
    """AMX tiles make bf16 matmuls several times faster than fp32 on a CPU; without them bf16 is slower."""
    return "amx_bf16" in cpu_flags()


# bf16 dot-product instructions: x86's AVX512-BF16 and AMX, ARM's BF16 extension. Without one of them oneDNN has no
# bf16 matmul and torch multiplies bf16 in plain C++: a 1024^3 product took 2.6 s against fp32's 0.085 s on an AMD
# EPYC with AVX2 only, 1.9 s against 0.026 s with oneDNN held to AVX2 on one with AVX512-BF16.
BF16_CPU_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}
# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) below its first ISA with bf16 dot products.
ISAS_WITHOUT_BF16 = {"sse41", "avx", "avx2", "avx2_vnni", "avx512_core", "avx512_core_vnni"}


def bf16_not_native(device_name: str | None = None, flags: set[str] | None = None,
                    environ: Mapping[str, str] | None = None) -> str | None:
    """None where `device_name` (default: this job's accelerator) multiplies bf16 in hardware; else why not, as a
    phrase a line can end with. A CPU is asked at run time: its flags, the oneDNN ISA cap in the environment, and
    whether this torch has oneDNN at all."""
    import torch
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    name = device_name or acc.device_name()
    if name == "cuda":  # torch's plain check counts the emulation a V100 or T4 runs bf16 with
        return None if torch.cuda.is_bf16_supported(including_emulation=False) else \
            "this GPU has no bf16 units (compute capability below 8.0)"
    if name != "cpu":
        return None if acc.is_bf16_supported() else f"this {name} device has no bf16 support"
    flags = cpu_flags() if flags is None else flags
    environ = os.environ if environ is None else environ
    if not flags & BF16_CPU_FLAGS:
        return "this CPU has no bf16 instructions (no avx512_bf16, amx_bf16 or ARM bf16 in /proc/cpuinfo)"
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        if environ.get(var, "").strip().lower() in ISAS_WITHOUT_BF16:
            return f"{var}={environ[var]} keeps oneDNN off this CPU's bf16 instructions"
    if not torch.backends.mkldnn.is_available():
        return "this torch was built without oneDNN, which multiplies bf16 on CPUs"
    return None


def default_precision(device_name: str | None = None) -> str:
    """What `precision: auto` means here: bf16 on accelerators that have it (fp16 otherwise);
    on a CPU, bf16 only with AMX, else fp32 (measured here: bf16 matmul 0.05 vs fp32 0.14 TFLOP/s
    per core without AMX)."""
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    name = device_name or acc.device_name()
    if name == "cpu":  # AMX held back by a oneDNN ISA cap computes bf16 in software: fp32 then
        return "bf16" if cpu_has_amx() and bf16_not_native("cpu") is None else "fp32"
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


# What DeepSpeed's accelerator detection (deepspeed.accelerator.real_accelerator) tries before it settles on the CPU:
# these packages, and torch's CUDA / ROCm / XPU builds (their libraries beside libtorch) or macOS's MPS.
ACCELERATOR_PACKAGES = ("torch_npu", "torch_sdaa", "habana_frameworks", "torch_mlu", "torch_supa", "torch_xmlir")
DEVICE_LIBRARIES = ("libtorch_cuda", "libtorch_hip", "libtorch_xpu")


def accelerator_name() -> str | None:
    """The accelerator DeepSpeed picks on this machine, its name only (no device is touched) and its detection kept
    quiet: "cpu" on a CPU-only install without importing DeepSpeed and torch; None where DeepSpeed cannot tell."""
    if cpu_only_install():
        return "cpu"  # all DeepSpeed could detect
    from bigtrain.metrics.logs import route_library_logs
    route_library_logs()
    try:
        from deepspeed.accelerator import get_accelerator
        return get_accelerator().device_name()
    except Exception:  # noqa: BLE001 -- no detection here: the ranks detect it themselves, loudly
        return None


def cpu_only_install() -> bool:
    """True where DeepSpeed can detect nothing but its CPU accelerator (a torch built for the CPU alone, not on macOS,
    no other accelerator's package), read from the installed files without importing torch (~1.9 CPU s)."""
    import importlib.util
    import sys
    if sys.platform == "darwin":
        return False
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib"
    if not (lib / "libtorch_cpu.so").is_file() or any(p.name.startswith(DEVICE_LIBRARIES) for p in lib.iterdir()):
        return False
    return not any(importlib.util.find_spec(name) for name in ACCELERATOR_PACKAGES)
