"""`train.compile` with the chunked loss trains the same losses as eager under the launcher at ZeRO-1 and
ZeRO-3 (inductor), one launch for the four jobs (the levers without a launcher:
tests/unit/test_compile.py)."""
from __future__ import annotations

import json

import pytest

from launch import launch_jobs
from messages import naming

STEPS = 10
RTOL = 2e-3
COMMON = ["--size", "tiny", "--data", "synthetic", "--set", "data.vocab_size=512", "--set", "data.seq_len=64",
          "--set", "precision=fp32", "--set", "logging.progress_bar=false", "--set", "train.sample_tokens=0",
          "--peak-tflops", "1", "--steps", str(STEPS), "--set", "train.eval_interval=0", "--set",
          "train.eval_batches=0", "--set", "batch.global_batch=8", "--set", "batch.micro_batch=4",
          "--set", "logging.csv=false", "--set", "checkpoint.at_end=false",
          # one block: what is compiled (every op of a block, the head and the chunked loss) is the same at any
          # depth, and inductor's cold compile, most of this file's time, grows with the graph
          "--set", "model.overrides.n_layer=1"]


@pytest.mark.slow
@pytest.mark.timeout(1200)  # cold inductor compiles: ~150 s of CPU in all; 400-600 s of wall time on a loaded host
def test_compiled_model_and_chunked_loss_train_the_same_losses_as_eager_at_zero1_and_zero3(tmp_path):
    jobs = [{"name": f"z{stage}_{mode}", "args": [*COMMON, "--set", f"zero.stage={stage}", *extra]}
            for stage in (1, 3)
            for mode, extra in (("eager", ["--set", "train.compile=false", "--set", "train.loss_impl=plain"]),
                                ("compiled", ["--set", "train.compile=true", "--set", "train.loss_impl=chunked"]))]
    log = launch_jobs(tmp_path, jobs, timeout=900, TORCHINDUCTOR_COMPILE_THREADS="1", TORCHDYNAMO_DISABLE="0")
    compiled = [line for line in log.splitlines() if naming(line, "compiled", "model", "loss", "inductor")]
    assert len(compiled) == 2, log[-3000:]  # one line per compiled job: what was compiled, by which backend
    for stage in (1, 3):
        eager, compiled = (json.loads((tmp_path / f"z{stage}_{mode}" / "summary.json").read_text())["losses"]
                           for mode in ("eager", "compiled"))
        assert len(eager) == len(compiled) == STEPS
        worst = max(abs(c - e) / abs(e) for c, e in zip(compiled, eager))
        print(f"\nZeRO-{stage}: compiled + chunked loss vs eager, max relative loss difference {worst:.2e}")
        assert worst <= RTOL, (stage, eager, compiled)
