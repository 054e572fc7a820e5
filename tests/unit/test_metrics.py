"""Metrics: peak matmul rate, MFU math, step timing, memory from tensors, the log line, the
progress bar, and DeepSpeed's CSV / TensorBoard monitors writing real files."""
from __future__ import annotations

import csv
import io
import json
import os
import time

import pytest
import torch

from bigtrain.metrics import (MetricsLogger, ProgressBar, ThroughputMeter, achieved_tflops, format_log_line,
                              measure_peak_tflops, memory_report, mfu, peak_memory, reset_peak_memory)



def test_measure_peak_tflops_is_quick_and_plausible():
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    peak = measure_peak_tflops("fp32", seconds=0.3)
    assert time.perf_counter() - t0 < 2.0
    assert 0.005 < peak < 10.0  # one CPU thread: tens to hundreds of GFLOP/s
    with pytest.raises(ValueError, match="unknown precision 'fp64'"):
        measure_peak_tflops("fp64")


@pytest.mark.parametrize("product_s, seconds, most_products, most_s", [
    (0.5, 0.2, 1, 0.7),  # one product outlasts the window (bf16 in software): the first product is the measurement
    (0.06, 0.2, 6, 0.45),  # slow products: one a batch, ending near the deadline
])
def test_measure_peak_tflops_is_bounded_by_time_not_by_products(monkeypatch, product_s, seconds, most_products,
                                                                most_s):
    calls = []

    def slow_mm(a, b):
        calls.append(time.perf_counter())
        time.sleep(product_s)
        return a

    monkeypatch.setattr(torch, "mm", slow_mm)
    t0 = time.perf_counter()
    peak = measure_peak_tflops("fp32", size=64, seconds=seconds)
    assert time.perf_counter() - t0 < most_s and len(calls) <= most_products, (time.perf_counter() - t0, calls)
    assert peak == pytest.approx(2 * 64 ** 3 / product_s / 1e12, rel=0.3)


def test_mfu_is_job_rate_over_ranks_times_per_rank_peak():
    # 6 GFLOP per sample at 100 samples/s over the job = 0.6 TFLOP/s; 2 ranks x 0.5 peak = 1.0
    assert achieved_tflops(6e9, 100) == pytest.approx(0.6)
    assert mfu(6e9, 100, peak_tflops_per_rank=0.5, world_size=2) == pytest.approx(0.6)
    assert mfu(6e9, 100, peak_tflops_per_rank=0.5, world_size=4) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="positive peak"):
        mfu(6e9, 100, 0.0, 2)


def test_throughput_meter_median_after_warmup():
    clock = iter([0.0, 10.0, 11.0, 13.0, 14.5, 15.0])  # start, then steps of 10, 1, 2, 1.5, 0.5 s
    meter = ThroughputMeter(warmup=1, clock=lambda: next(clock))
    meter.start()
    for _ in range(5):
        meter.step(samples=8, tokens=8 * 256)
    assert meter.times == [10.0, 1.0, 2.0, 1.5, 0.5]
    assert meter.median_step_s() == pytest.approx(1.25)  # median of 1, 2, 1.5, 0.5
    assert meter.samples_per_s() == pytest.approx(6.6666667)  # median of 8, 4, 5.33, 16
    assert meter.tokens_per_s() == pytest.approx(256 * 6.6666667)
    short = ThroughputMeter(warmup=3, clock=iter([0.0, 2.0]).__next__)
    short.start()
    short.step(samples=4)
    assert short.samples_per_s() == 2.0  # fewer steps than the warm-up: use what there is


def test_memory_report_counts_params_grads_and_adam_states():
    model = torch.nn.Sequential(torch.nn.Linear(100, 200), torch.nn.Linear(200, 10))
    psi = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 100)).sum().backward()
    opt.step()
    report = memory_report(model, opt)
    assert report["params_bytes"] == 4 * psi and report["grads_bytes"] == 4 * psi
    assert report["optimizer_bytes"] == 8 * psi + 4 * 4  # exp_avg, exp_avg_sq + a scalar step per tensor
    assert report["model_state_bytes"] == 16 * psi + 16
    tied = torch.nn.Linear(50, 50)
    shared = torch.nn.ModuleList([tied, tied])  # one storage counted once
    assert memory_report(shared)["params_bytes"] == 4 * (50 * 50 + 50)


# ZeRO-2 releases its gradient buckets at the end of backward; ZeRO-3 keeps one for the whole run.
@pytest.mark.parametrize("stage, bucket_bytes", [(2, 0), (3, 4 * 10**6)])
def test_memory_report_reads_zero_partitions(one_rank_group, stage, bucket_bytes):
    import deepspeed
    model = torch.nn.Sequential(torch.nn.Linear(400, 400), torch.nn.Linear(400, 400))
    psi = sum(p.numel() for p in model.parameters())
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 10**6,
                                    "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 400)).pow(2).mean())
        report = memory_report(engine)
        engine.step()
    # ZeRO >= 1 keeps an fp32 master partition even in fp32 training: 4 + 4 + (4 + 8) = 20 bytes per parameter
    assert report["params_bytes"] == 4 * psi
    assert report["optimizer_bytes"] == pytest.approx(12 * psi, abs=64)
    assert report["grads_bytes"] == 4 * psi
    assert report["model_state_bytes"] == pytest.approx(20 * psi, abs=64)
    assert report["buffers_bytes"] == bucket_bytes and report["host_bytes"] == 0


def test_peak_memory_on_cpu_reports_rss_under_its_name():
    before = peak_memory()
    assert "peak_device_bytes" not in before and before["peak_rss_bytes"] >= before["rss_bytes"] > 0
    block = torch.ones(300 * 2**20 // 4)  # 300 MiB, touched
    after = peak_memory()
    assert after["peak_rss_bytes"] >= before["rss_bytes"] + 250 * 2**20
    del block
    reset_peak_memory()  # Linux: the high-water mark restarts from the current RSS
    assert peak_memory()["peak_rss_bytes"] < after["peak_rss_bytes"] - 200 * 2**20


def test_format_log_line():
    line = format_log_line(20, 200, loss=3.41234, lr=3e-4, tokens_per_s=12_345, tflops=1.85, mfu=0.312,
                           mem_bytes=2.1e9)
    assert line == "step 20/200 | loss 3.412 | lr 3.0e-04 | 12.3k tok/s | 1.85 TFLOP/s | MFU 31.2% | mem 2.1 GB/rank"
    assert format_log_line(3, 10, samples_per_s=950.0) == "step 3/10 | 950.0 samples/s"
    assert format_log_line(3, 10, loss=1.0, grad_norm=0.8234) == "step 3/10 | loss 1.000 | grad norm 0.823"


def test_progress_bar_plain_lines_when_not_a_tty():
    out = io.StringIO()
    bar = ProgressBar(25, stream=out, log_every=10)
    for step in range(1, 26):
        bar.update(step, loss=5.0 - step / 10)
    lines = out.getvalue().splitlines()
    assert [line.split(" |")[0] for line in lines] == ["step 10/25", "step 20/25", "step 25/25"]
    assert lines[0].startswith("step 10/25 | loss 4.000 |") and " | ETA " in lines[0]
    assert lines[-1].endswith("ETA 0:00")


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_tty_is_a_tqdm_bar_and_log_lines_go_above_it():
    import logging
    out = FakeTTY()
    handler = logging.StreamHandler(out)
    logger = logging.getLogger("bigtrain")
    logger.addHandler(handler)
    try:
        bar = ProgressBar(4, stream=out, min_interval=0.0)
        for step in range(1, 5):
            bar.tick(step)
            if step == 2:
                bar.update(step, loss=1.0)
                logger.warning("a log line")
                bar.write("eval step 2: val loss 0.9")
        bar.update(4, loss=0.5)
        logger.warning("after the bar")
    finally:
        logger.removeHandler(handler)
    text = out.getvalue()
    assert "2/4 [" in text and ", loss 1.000]" in text and "100%|" in text and "4/4 [" in text and "loss 0.500]" in text
    # tqdm lifts the bar (\r + blanks + \r), prints the line, then redraws the bar below it
    for line in ("a log line", "eval step 2: val loss 0.9"):
        before, after = text.split(line + "\n", 1)
        assert before.endswith("\r") and after.startswith("\r") and "/4 [" in after.split("\n")[0]
    assert text.endswith("\nafter the bar\n") and handler.stream is out  # logging has its stream back
    silent = FakeTTY()
    ProgressBar(4, stream=silent, enabled=False).update(1, loss=1.0)
    assert silent.getvalue() == ""


def test_metrics_logger_writes_csv_and_tensorboard(one_rank_group, tmp_path):
    from bigtrain.ds.generate import monitor_sections
    logger = MetricsLogger(monitor_sections(str(tmp_path), "job", tensorboard=True, csv=True))
    for step in (1, 2, 3):
        logger.log(step, {"loss": 4.0 - step, "tokens_per_s": 1000.0 * step, "mfu": None})
    logger.flush()
    with open(tmp_path / "csv" / "job" / "bigtrain_loss.csv") as f:
        assert list(csv.reader(f)) == [["step", "loss"], ["1", "3.0"], ["2", "2.0"], ["3", "1.0"]]
    assert not (tmp_path / "csv" / "job" / "bigtrain_mfu.csv").exists()  # None is left out

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "tensorboard" / "job"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("bigtrain/tokens_per_s")] == [(1, 1000.0), (2, 2000.0),
                                                                                  (3, 3000.0)]
    summary = json.loads(logger.write_summary(tmp_path / "summary.json", {"world_size": 1}).read_text())
    assert summary["summary"] == {"loss": 2.0, "tokens_per_s": 2000.0, "step": 3}
    assert summary["history"][0] == {"step": 1, "loss": 3.0, "tokens_per_s": 1000.0} and summary["world_size"] == 1


def test_metrics_logger_without_monitors_keeps_history():
    logger = MetricsLogger({"csv_monitor": {"enabled": False}})
    assert logger.monitor is None
    logger.log(5, {"loss": 1.5, "lr": float("nan")})
    assert logger.history == [{"step": 5, "loss": 1.5}]
