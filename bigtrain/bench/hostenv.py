"""The environment every benchmark job gets, and the host facts a benchmark table must state.

bigtrain and both baselines run with exactly this environment (threads per rank, malloc
tunables, core binding), which is the one `bigtrain train` gives its ranks.
"""
from __future__ import annotations

import os
import platform
import time
from pathlib import Path

from bigtrain.distributed.device import cpu_flags
from bigtrain.launch.train import thread_env

HF_OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def job_env(num_ranks: int = 2, timeout_minutes: int = 5, extra: dict | None = None) -> dict[str, str]:
    """The runner's environment for `num_ranks` ranks, plus a collective timeout so nothing hangs."""
    env = thread_env(num_ranks)
    env.update(HF_OFFLINE)
    env.update(PYTHONUNBUFFERED="1", DEEPSPEED_TIMEOUT=str(int(timeout_minutes)))  # DeepSpeed parses an int
    env.update(extra or {})
    return env


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory_total_bytes() -> int:
    import psutil
    return int(psutil.virtual_memory().total)


def cpu_busy_fraction(seconds: float = 1.0) -> float:
    """Share of all cores busy over `seconds` (every process on the host, not just ours)."""
    import psutil
    return psutil.cpu_percent(interval=seconds) / 100.0


def host_facts() -> dict:
    """What a reader needs to judge the numbers: CPU, its matmul extensions, cores, memory, load."""
    flags = cpu_flags()
    return {
        "cpu": cpu_model(), "cores": os.cpu_count(), "memory_gib": round(memory_total_bytes() / 2**30, 1),
        "amx": "amx_bf16" in flags, "avx512_bf16": "avx512_bf16" in flags,
        "load_avg_1m": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d %H:%M"),
    }


class LoadLog:
    """Samples of host CPU use taken between jobs: the table states how busy the machine was."""

    def __init__(self) -> None:
        self.samples: list[float] = []

    def sample(self, seconds: float = 1.0) -> float:
        busy = cpu_busy_fraction(seconds)
        self.samples.append(busy)
        return busy

    def summary(self) -> dict:
        if not self.samples:
            return {}
        ordered = sorted(self.samples)
        return {"busy_min": ordered[0], "busy_median": ordered[len(ordered) // 2], "busy_max": ordered[-1],
                "samples": len(ordered)}
