"""The one training loop the reference baselines share, and what they share with bigtrain.

A baseline (`baseline_deepspeed`, `baseline_ddp`, `baseline_nanogpt`) supplies only how it starts
its ranks and wraps and steps the model: a `wrap(job, ds_config) -> Trainer`. Everything it
measures is the same code here: the job description, the synthetic data, the step clock, the
result file. The model comes from `bigtrain.models.build` (for GPT-2 that is HF's
`GPT2LMHeadModel`, as a user would build it) and the data from `bigtrain.data.synthetic`, so every
runner trains the same network on the same kind of batches; the rest is the baseline's own code.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn

import torch
from deepspeed.accelerator import get_accelerator

from bigtrain import models
from bigtrain.metrics import memory_report, peak_memory

WARMUP = 2  # steps left out of the median, as bigtrain's ThroughputMeter does


@dataclass
class Trainer:
    """What a baseline hands the loop: its model wrapped, and one micro-batch's forward, backward and step."""

    spec: Any  # the model spec (`bigtrain.models.build`): loss, batch_to_inputs, sizes for the result
    device: torch.device
    input_dtype: torch.dtype  # floating inputs (images) take the model's dtype
    micro_batch: int  # per rank
    accum: int  # micro-batches per optimizer step
    global_batch: int  # samples per optimizer step over all ranks
    micro_step: Callable[[Any, torch.Tensor], torch.Tensor]  # (inputs, labels) on the device -> the loss
    memory: Callable[[], dict]  # `metrics.memory_report` of this rank's model state, read after the loop
    extra: dict  # baseline-specific fields of the result ("runner" at least)
    # Objects that must outlive the loop: transformers holds HfDeepSpeedConfig by a weak reference.
    hold: tuple = ()


Wrap = Callable[[dict, dict | None], Trainer]  # (job, the DeepSpeed JSON if the baseline takes one) -> Trainer


def main(doc: str, wrap: Wrap, argv: list[str] | None = None, takes_ds_config: bool = False) -> int:
    """Parse the launcher's arguments, train `job["steps"]` steps through `wrap`'s trainer, write this rank's result."""
    p = argparse.ArgumentParser(description=doc)
    p.add_argument("--job", required=True)
    if takes_ds_config:
        p.add_argument("--ds-config", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    job = load_job(args.job)
    ds_config = json.loads(Path(args.ds_config).read_text()) if takes_ds_config else None

    same_rank_setup()
    t = wrap(job, ds_config)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    spec = t.spec
    data = synthetic_batches(job, rank, world, t.micro_batch)
    clock, losses = StepClock(), []
    for _ in range(job["steps"]):
        for _ in range(t.accum):
            inputs, labels = spec.batch_to_inputs(next(data))
            loss = t.micro_step(to_device(inputs, t.device, t.input_dtype), labels.to(t.device))
        losses.append(loss.item())  # one host sync per step (nanoGPT's logging does the same)
        clock.tick()

    write_result(args.out, rank, clock, t.global_batch, losses, spec, t.memory(), t.extra)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


def leave(code: int) -> NoReturn:
    """End a baseline's process once its result is on disk.

    Skips the interpreter's teardown: with ZeRO-3 it sometimes aborts ("terminate called without an
    active exception") and the launcher then reports a failed job for a run that measured everything.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# --- what the plain-PyTorch baselines (DDP, nanoGPT) share ------------------------------------------

def torch_process_group() -> torch.device:
    """Join the process group the launcher described (RANK, WORLD_SIZE, MASTER_ADDR/PORT); this rank's device."""
    acc = get_accelerator()
    torch.distributed.init_process_group(acc.communication_backend_name())
    device = torch.device(acc.device_name(int(os.environ.get("LOCAL_RANK", "0"))))
    if device.type != "cpu":
        acc.set_device(device.index)
    return device


def adamw_kwargs(opt: dict) -> dict[str, Any]:
    """torch AdamW's arguments from the job's optimizer settings (those of the DeepSpeed JSON)."""
    return dict(lr=opt["lr"], betas=tuple(opt["betas"]), eps=opt["eps"], weight_decay=opt["weight_decay"])


def torch_trainer(job: dict, spec: Any, raw: torch.nn.Module, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  device: torch.device, extra: dict, compile_it: bool = False) -> Trainer:
    """A plain PyTorch step on `model` (`raw` itself or `raw` in DDP): the loss under bf16 autocast (fp32
    weights), backward, clipping at the job's gradient_clipping as DeepSpeed does, the optimizer step; one
    micro-batch per step."""
    bf16 = job["precision"] == "bf16"
    step_loss = loss_fn(model, spec, compile_it)

    def micro_step(inputs: Any, labels: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = step_loss(inputs, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(raw.parameters(), job["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    micro = job["micro_batch"]
    return Trainer(spec, device, torch.float32, micro, 1, micro * torch.distributed.get_world_size(), micro_step,
                   lambda: memory_report(raw, optimizer), extra)


def loss_fn(model: torch.nn.Module, spec: Any, compile_it: bool) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """(inputs, labels) -> loss: forward and loss in one function, compiled together when asked (nanoGPT)."""
    def step_loss(inputs: Any, labels: torch.Tensor) -> torch.Tensor:
        return spec.loss(model(inputs), labels)
    return torch.compile(step_loss) if compile_it else step_loss


def seeded_spec(job: dict) -> Any:
    """The job's model spec, after seeding torch as every runner does before building the model."""
    torch.manual_seed(job["seed"])
    return models.build(job["family"], job["size"], **job["spec_kwargs"])


# --- the job, the data, the clock, the result -------------------------------------------------------

def same_rank_setup() -> None:
    """The core binding and malloc settings bigtrain's ranks give themselves (before the process group)."""
    from bigtrain.distributed.host import tune_cpu_rank
    if get_accelerator().device_name() == "cpu":
        tune_cpu_rank()


def load_job(path: str) -> dict:
    return json.loads(Path(path).read_text())


def synthetic_batches(job: dict, rank: int, world: int, micro_batch: int) -> Iterator[dict]:
    """Endless micro-batches of this rank's share of the same synthetic set bigtrain trains on."""
    from bigtrain.data.synthetic import SyntheticImages, synthetic_tokens
    n = job["synthetic_samples"]
    if job["modality"] == "text":
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
