"""Run by tests/dist/test_estimate_measured.py through `deepspeed --num_gpus 2`: measured per-rank memory per ZeRO stage.

Usage: estimate_memory.py OUT_DIR PRECISION STAGE [STAGE ...] [--micro-batch B]
For each stage, every rank builds a small GPT-2 (bigtrain.models), wraps it with plain
`deepspeed.initialize` (AdamW via torch_adam), trains two steps and writes
OUT_DIR/stage{S}_rank{R}.json with
- the model-state bytes counted from the tensors (bigtrain.metrics.memory_report), taken
  after step 1 and just before and after DeepSpeed reduces the step-2 gradients (the peak
  of model states is the largest of these), and
- the growth of this process's peak RSS over its RSS before the model was built. The test
  runs this with MALLOC_MMAP_THRESHOLD_ fixed, so that glibc returns freed tensors to the
  OS and RSS follows live tensors; reset_peak_memory() resets the peak between stages.
"""
from __future__ import annotations

import gc
import json
import os
import sys

import deepspeed
import torch
from deepspeed import comm as dist

from bigtrain.metrics import memory_report, peak_rss_bytes, reset_peak_memory, rss_bytes
from bigtrain.models import build

SHAPE = dict(n_layer=2, n_embd=256, n_head=4, n_positions=128, vocab_size=2048)
SEQ, BUCKET = 128, 1_000_000


def ds_config(stage: int, precision: str, micro: int, world: int) -> dict:
    zero: dict = {"stage": stage}
    if stage > 0:
        zero.update(reduce_bucket_size=BUCKET, allgather_bucket_size=BUCKET)
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=BUCKET)
    return {"train_batch_size": micro * world, "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": 1, "zero_optimization": zero, "steps_per_print": 10**6,
            "bf16": {"enabled": precision == "bf16"},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}


def measure(stage: int, precision: str, micro: int, shape: dict = SHAPE) -> dict:
    gc.collect()
    reset_peak_memory()
    rss0 = rss_bytes()
    torch.manual_seed(0)
    spec = build("gpt2", "custom", **shape)
    model = spec.build()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(stage, precision, micro, dist.get_world_size()))
    ids = torch.randint(0, shape["vocab_size"], (micro, SEQ), generator=torch.Generator().manual_seed(dist.get_rank()))
    snapshots = {}
    reduce = engine.allreduce_gradients

    def reduce_with_snapshots(*args, **kwargs):  # stage 1 holds full gradients until this reduction
        snapshots["before_reduce"] = memory_report(engine)
        reduce(*args, **kwargs)
        snapshots["after_reduce"] = memory_report(engine)

    losses = []
    for step in range(2):
        if step == 1:
            engine.allreduce_gradients = reduce_with_snapshots
        loss = spec.loss(engine(ids), ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step == 0:
            snapshots["after_step1"] = memory_report(engine)
    peak_growth = peak_rss_bytes() - rss0
    psi = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    numels = [getattr(p, "ds_numel", p.numel()) for p in model.parameters()]
    result = {"stage": stage, "precision": precision, "micro_batch": micro, "world_size": dist.get_world_size(),
              "num_params": psi, "param_numels": numels, "snapshots": snapshots, "losses": losses,
              "rss_before": rss0, "peak_rss_growth": peak_growth,
              "peak_model_state_bytes": max(s["model_state_bytes"] for s in snapshots.values())}
    engine.destroy() if hasattr(engine, "destroy") else None
    del engine, model
    gc.collect()
    return result


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    micro = 4
    if "--micro-batch" in args:
        i = args.index("--micro-batch")
        micro = int(args[i + 1])
        del args[i:i + 2]
    out_dir, precision, *stages = args
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    # A throwaway ZeRO-1 run of the same model first: imports, kernels and the communication
    # layer's one-time memory (~40 MB of anonymous memory that stays after the first ZeRO-1
    # reduction here, held by no Python tensor) must not land in any stage's growth.
    measure(1, precision, 1)
    for stage in map(int, stages):
        result = measure(stage, precision, micro)
        with open(os.path.join(out_dir, f"stage{stage}_rank{dist.get_rank()}.json"), "w") as f:
            json.dump(result, f)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
