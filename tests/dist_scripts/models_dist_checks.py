"""Run by tests/dist/test_parallel_ranks.py through `deepspeed --num_gpus 2`: the 2-rank checks of
bigtrain.parallel in one launch (the launcher's start-up dominates on a 2-core CPU).

Usage: models_dist_checks.py OUT_DIR
Writes OUT_DIR/rank{R}.json: {"rank", "checkpointing", "zero3", "pipeline"}, one section per
check module next to this file. The order matters, as DeepSpeed and transformers keep
process-wide state: a pipeline engine leaves its grid in `deepspeed.utils.groups` (a later
plain engine would take it for model parallelism), and while a ZeRO-3 model lives
transformers builds every model under zero.Init.
"""
from __future__ import annotations

import json
import os
import sys

import deepspeed
from deepspeed import comm as dist
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled, unset_hf_deepspeed_config

import models_checkpointing_configured
import models_pipeline_tied
import models_zero3_init


def main() -> None:
    (out_dir,) = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    report = {"rank": rank, "checkpointing": models_checkpointing_configured.check(),
              "zero3": models_zero3_init.check(os.path.join(out_dir, "pretrained"))}
    unset_hf_deepspeed_config()  # the ZeRO-3 engine still holds its model and transformers' switch
    assert not is_deepspeed_zero3_enabled()
    report["pipeline"] = models_pipeline_tied.check()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
