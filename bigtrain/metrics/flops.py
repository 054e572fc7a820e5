"""Peak matmul rate, achieved FLOP/s and MFU, and a step timer.

Peak and achieved rates are both *per rank* here: every rank owns its own device (or its
own CPU threads), so the job's peak is `peak_tflops_per_rank * world_size` and MFU is the
job's achieved FLOP/s over that. MFU counts the model's FLOPs only (`spec.flops_per_sample`,
forward + backward); recomputation under activation checkpointing is not credited, as in
the PaLM paper's definition.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
from deepspeed.accelerator import get_accelerator

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """torch dtype from a dtype or a precision name (fp32 | bf16 | fp16)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown precision {dtype!r}; use one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def measure_peak_tflops(dtype: torch.dtype | str = torch.float32, device: str | None = None,
                        size: int | None = None, seconds: float = 0.5) -> float:
    """Best square-matmul rate in TFLOP/s on `device` with the current torch thread count.

    Two warm-up products, then timed batches of products until `seconds` have passed, each batch timed between
    accelerator synchronizations; returns the fastest batch's rate. Bounded by time, not by a count of products:
    about `seconds` a call, twice that at most, or one product's time where a single product outlasts `seconds`
    (bf16 on a CPU that computes it in software: ~2.6 s a product at 1024), whose rate is then the measurement.
    `size` defaults to 1024 on CPU (a few ms per product) and 4096 elsewhere.
    """
    dtype = as_dtype(dtype)
    acc = get_accelerator()
    device = device or acc.current_device_name()
    on_cpu = torch.device(device).type == "cpu"
    n = size or (1024 if on_cpu else 4096)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    flops_per_product = 2.0 * n ** 3
    deadline = time.perf_counter() + seconds
    for _ in range(2):  # the first product also picks the kernel (and starts cuBLAS): the second is the steady one
        acc.synchronize()
        t0 = time.perf_counter()
        torch.mm(a, b)
        acc.synchronize()
        one = time.perf_counter() - t0
        if time.perf_counter() >= deadline:
            return flops_per_product / one / 1e12
    products = 2 if on_cpu else 20  # per timed batch: long enough to dwarf the timer on a GPU
    if products * one > seconds / 2:  # slow products: one a batch, so that the last batch ends near the deadline
        products = 1
    best = float("inf")
    while best == float("inf") or time.perf_counter() < deadline:
        acc.synchronize()
        t0 = time.perf_counter()
        for _ in range(products):
            torch.mm(a, b)
        acc.synchronize()
        best = min(best, (time.perf_counter() - t0) / products)
    return flops_per_product / best / 1e12


def achieved_tflops(flops_per_sample: float, samples_per_s: float) -> float:
    """Model TFLOP/s achieved by whatever processed `samples_per_s` (a rank or the whole job)."""
    return flops_per_sample * samples_per_s / 1e12


def mfu(flops_per_sample: float, samples_per_s: float, peak_tflops_per_rank: float, world_size: int) -> float:
    """Model FLOPs utilization in [0, 1]: job-wide achieved rate over `world_size` x the per-rank peak.

    `samples_per_s` is the job's rate (all data-parallel ranks together), as
    `global_batch / step_time`.
    """
    if peak_tflops_per_rank <= 0 or world_size < 1:
        raise ValueError(f"mfu needs a positive peak (got {peak_tflops_per_rank}) and world_size >= 1 "
                         f"(got {world_size}); pass --peak-tflops or let bigtrain measure it")
    return achieved_tflops(flops_per_sample, samples_per_s) / (peak_tflops_per_rank * world_size)


class ThroughputMeter:
    """Wall time per optimizer step (after an accelerator synchronize), median after `warmup` steps.

    Call `start()` before the first step and `step(samples, tokens)` after each one. Call
    `restart()` after anything that is not training (eval, checkpoint) so that its time
    does not land in the next step.
    """

    def __init__(self, warmup: int = 2, clock: Callable[[], float] = time.perf_counter) -> None:
        assert warmup >= 0
        self.warmup, self.clock = warmup, clock
        self.times: list[float] = []
        self.samples: list[float] = []
        self.tokens: list[float] = []
        self._mark: float | None = None

    def start(self) -> None:
        get_accelerator().synchronize()
        self._mark = self.clock()

    restart = start

    def step(self, samples: float, tokens: float = 0.0) -> float:
        """Record one step that processed `samples` (and `tokens`); returns its wall time in s."""
        assert self._mark is not None, "ThroughputMeter.start() was not called"
        get_accelerator().synchronize()
        now = self.clock()
        dt, self._mark = now - self._mark, now
        self.times.append(dt)
        self.samples.append(samples)
        self.tokens.append(tokens)
        return dt

    @property
    def count(self) -> int:
        return len(self.times)

    def _measured(self) -> slice:
        # With too few steps, use what there is rather than nothing.
        return slice(self.warmup if len(self.times) > self.warmup else 0, None)

    def median_step_s(self) -> float:
        """Median step time over the steps after the warm-up (nan before any step)."""
        times = self.times[self._measured()]
        return statistics.median(times) if times else float("nan")

    def samples_per_s(self) -> float:
        """Median over measured steps of samples / step time."""
        return self._median_rate(self.samples)

    def tokens_per_s(self) -> float:
        return self._median_rate(self.tokens)

    def _median_rate(self, amounts: list[float]) -> float:
        sl = self._measured()
        rates = [n / t for n, t in zip(amounts[sl], self.times[sl]) if t > 0]
        return statistics.median(rates) if rates else float("nan")
