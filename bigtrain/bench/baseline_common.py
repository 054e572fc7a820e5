"""What both reference loops share with bigtrain: the job description, the synthetic data, the step clock.

The model comes from `bigtrain.models.build` (for GPT-2 that is HF's `GPT2LMHeadModel`, as a
user would build it) and the data from `bigtrain.data.synthetic`, so all three runners train
the same network on the same kind of batches; everything else is the baseline's own code.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Iterator

import torch

WARMUP = 2  # steps left out of the median, as bigtrain's ThroughputMeter does


def same_rank_setup() -> None:
    """The core binding and malloc settings bigtrain's ranks give themselves (before the process group)."""
    from deepspeed.accelerator import get_accelerator

    from bigtrain.distributed.world import tune_cpu_rank
    if get_accelerator().device_name() == "cpu":
        tune_cpu_rank()


def load_job(path: str) -> dict:
    return json.loads(Path(path).read_text())


def synthetic_batches(job: dict, rank: int, world: int, micro_batch: int) -> Iterator[dict]:
    """Endless micro-batches of this rank's share of the same synthetic set bigtrain trains on."""
    from bigtrain.data.synthetic import SyntheticImages, synthetic_tokens
    n = job["synthetic_samples"]
    if job["family"] == "gpt2":
        data: Any = synthetic_tokens(n, job["seq_len"], job["vocab_size"], job["seed"])
    else:
        data = SyntheticImages(n, job["image_size"], job["num_classes"], job["seed"])
    order = torch.randperm(n, generator=torch.Generator().manual_seed(job["seed"])).tolist()
    mine = order[rank::world]
    i = 0
    while True:
        idx = [mine[(i + k) % len(mine)] for k in range(micro_batch)]
        i += micro_batch
        yield data.take(idx)


def to_device(value: Any, device: Any, float_dtype: torch.dtype) -> Any:
    """Move a batch's inputs; floating inputs (images) take the model's dtype."""
    if isinstance(value, torch.Tensor):
        value = value.to(device)
        return value.to(float_dtype) if value.is_floating_point() else value
    return value


class StepClock:
    """Wall time between consecutive step ends, like bigtrain's ThroughputMeter."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.mark = time.perf_counter()

    def tick(self) -> None:
        now = time.perf_counter()
        self.times.append(now - self.mark)
        self.mark = now

    def measured(self) -> list[float]:
        return self.times[WARMUP:] if len(self.times) > WARMUP else self.times

    def rate(self, amount: float) -> float:
        """Median over measured steps of amount / step time (bigtrain's definition of samples/s)."""
        return statistics.median(amount / t for t in self.measured())


def write_result(out: str, rank: int, clock: StepClock, global_batch: int, losses: list[float],
                 spec: Any, memory: dict, extra: dict | None = None) -> None:
    """One JSON per rank: step times, rate, losses, memory; the bench merges the ranks' files."""
    from bigtrain.metrics import peak_memory
    result = {
        "rank": rank, "step_times": clock.times, "step_s_median": statistics.median(clock.measured()),
        "samples_per_s": clock.rate(global_batch),
        "losses": losses, "num_params": spec.num_params, "flops_per_sample": spec.flops_per_sample,
        "tokens_per_sample": spec.tokens_per_sample, "global_batch": global_batch,
        "peak_memory": peak_memory(), "model_state_bytes": memory["model_state_bytes"],
        "affinity": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads(), **(extra or {}),
    }
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"result_rank{rank}.json").write_text(json.dumps(result))
