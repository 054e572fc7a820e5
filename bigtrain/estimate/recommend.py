"""Which setups to weigh and which to take: every ZeRO stage x offload x checkpointing DeepSpeed supports, whether an
estimate fits a device, and the fastest that does."""
from __future__ import annotations

from dataclasses import replace

from bigtrain.config.rules import Layout, layout_problems
from bigtrain.estimate.memory_model import OFFLOADS, MemoryEstimate, Setup


def all_setups(base: Setup) -> list[Setup]:
    """Every stage x offload x checkpointing DeepSpeed supports, from `base`'s other settings."""
    setups = []
    for stage in (0, 1, 2, 3):
        for opt, param in OFFLOADS:
            if layout_problems(Layout(stage, opt, param)):
                continue  # a combination DeepSpeed cannot run (bigtrain.config.rules)
            for ckpt in (False, True):
                setups.append(replace(base, zero_stage=stage, offload_optimizer=opt, offload_param=param,
                                      checkpointing=ckpt))
    return setups


def speed_rank(setup: Setup) -> tuple[int, int, int]:
    """Sort key, fastest first: offloading (host traffic) costs most, then recomputing activations
    (about a third more compute), then the ZeRO stage (ZeRO-3 gathers parameters twice per step)."""
    return (OFFLOADS.index((setup.offload_optimizer, setup.offload_param)), int(setup.checkpointing),
            setup.zero_stage)


def fits(est: MemoryEstimate, gpu_mem: float, cpu_mem: float | None = None, headroom: float = 0.1) -> bool:
    """Whether the device peak fits in (1 - headroom) of `gpu_mem` (CUDA context, fragmentation),
    and the host part per node in `cpu_mem` when given."""
    ok = est.device_peak <= (1 - headroom) * gpu_mem
    if cpu_mem is not None:
        ok = ok and est.host_per_node <= (1 - headroom) * cpu_mem
    return ok


def recommend(estimates: list[MemoryEstimate], gpu_mem: float, cpu_mem: float | None = None,
              headroom: float = 0.1) -> MemoryEstimate | None:
    """The fastest configuration that fits, or None."""
    fitting = [e for e in estimates if fits(e, gpu_mem, cpu_mem, headroom)]
    return min(fitting, key=lambda e: speed_rank(e.setup)) if fitting else None

