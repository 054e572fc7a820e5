"""bf16 where the device multiplies it natively, and only there. On a CPU without bf16 instructions (an AMD EPYC
with AVX2 only) torch multiplies bf16 in plain C++: a 1024^3 product took 2.6 s against fp32's 0.085 s, and the
bench's peak job (bf16 then fp32 squares) was killed after 300 s. The check is asked at run time (the CPU's flags,
the oneDNN ISA cap in the environment); the bench then measures fp32 only and trains its CPU plans in fp32, a
training run's MFU is against the fp32 peak, each saying why in one line. The same logic runs on a CPU with native
bf16 here, with the check's answer given."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from bigtrain.bench.cases import Case, Strategy, Workload
from bigtrain.bench.doc import conditions
from bigtrain.bench.peak import read_peaks
from bigtrain.bench.rows import check_rows, make_row
from bigtrain.bench.sweep import full_plan, in_fp32, peaks_line, row_line, short_plan
from bigtrain.distributed import device
from bigtrain.distributed.device import bf16_not_native

NO_BF16 = "this CPU has no bf16 instructions (no avx512_bf16, amx_bf16 or ARM bf16 in /proc/cpuinfo)"
ZEN3 = {"fpu", "sse4_2", "avx", "avx2", "fma"}  # an AMD EPYC 7003's flags, in part
SAPPHIRE_RAPIDS = ZEN3 | {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}


@pytest.mark.parametrize("flags, environ, expected", [
    (ZEN3, {}, NO_BF16),
    (SAPPHIRE_RAPIDS, {}, None),
    (ZEN3 | {"avx512f", "avx512_bf16"}, {}, None),  # AVX512-BF16 without AMX: native, if slower than fp32
    ({"fp", "asimd", "bf16"}, {}, None),  # ARM's Features line (Graviton 3)
    ({"fp", "asimd"}, {}, NO_BF16),  # Graviton 2
    (SAPPHIRE_RAPIDS, {"ONEDNN_MAX_CPU_ISA": "AVX2"}, "ONEDNN_MAX_CPU_ISA=AVX2 keeps oneDNN off this CPU's bf16 "
                                                     "instructions"),
    (SAPPHIRE_RAPIDS, {"DNNL_MAX_CPU_ISA": "avx512_core"}, "DNNL_MAX_CPU_ISA=avx512_core keeps oneDNN off this CPU's "
                                                           "bf16 instructions"),
    (SAPPHIRE_RAPIDS, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, None),
])
def test_native_bf16_is_asked_of_the_cpu_at_run_time(flags, environ, expected):
    assert bf16_not_native("cpu", flags=flags, environ=environ) == expected


def test_a_gpu_emulating_bf16_is_not_native(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: asked.append(
        including_emulation) or including_emulation)  # a V100: bf16 only emulated
    assert bf16_not_native("cuda") == "this GPU has no bf16 units (compute capability below 8.0)" and asked == [False]
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)  # an H100
    assert bf16_not_native("cuda") is None


def test_this_hosts_answer_agrees_with_its_flags_and_the_oneDNN_cap(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    native = bool(device.cpu_flags() & device.BF16_CPU_FLAGS) and torch.backends.mkldnn.is_available()
    assert (bf16_not_native("cpu") is None) == native
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # how the suite emulates a CPU without bf16 on one with it
    assert bf16_not_native("cpu") is not None


def test_precision_auto_takes_bf16_on_a_cpu_only_with_amx_that_onednn_may_use(monkeypatch):
    from bigtrain.distributed.device import default_precision
    monkeypatch.setattr(device, "cpu_flags", lambda: SAPPHIRE_RAPIDS)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    assert default_precision("cpu") == "bf16"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert default_precision("cpu") == "fp32"
    monkeypatch.setattr(device, "cpu_flags", lambda: ZEN3 | {"avx512f", "avx512_bf16"})
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert default_precision("cpu") == "fp32"  # AVX512-BF16 alone: native, but slower than fp32 (docs/benchmarks.md)


def test_the_peak_job_measures_fp32_only_and_says_why(monkeypatch, tmp_path):
    from bigtrain.bench import peak
    asked = []
    monkeypatch.setattr(device, "bf16_not_native", lambda name=None: NO_BF16)
    monkeypatch.setattr("bigtrain.metrics.measure_peak_tflops",
                        lambda dtype, size, seconds: asked.append((dtype, size)) or 0.1 * size / 1024)
    result = peak.measure(0.01)
    assert asked == [("fp32", 1024), ("fp32", 2048)]  # never a bf16 product
    assert result["bf16"] is None and result["fp32"] == pytest.approx(0.2) and result["bf16_not_measured"] == NO_BF16
    for rank in range(2):
        (tmp_path / f"peak_rank{rank}.json").write_text(json.dumps({"rank": rank, **result}))
    peaks = read_peaks(tmp_path)
    assert (peaks["bf16"], peaks["fp32"], peaks["bf16_not_measured"]) == (None, pytest.approx(0.2), NO_BF16)
    assert peaks_line(peaks) == f"bf16 not measured ({NO_BF16}), fp32 0.200 TFLOP/s"  # the bench's log line
    monkeypatch.setattr(device, "bf16_not_native", lambda name=None: None)
    asked.clear()
    assert peak.measure(0.01)["bf16"] == pytest.approx(0.2) and "bf16_not_measured" not in peak.measure(0.01)
    assert asked[:4] == [("bf16", 1024), ("bf16", 2048), ("fp32", 1024), ("fp32", 2048)]


def test_the_cpu_plans_train_their_bf16_workloads_in_fp32_and_drop_the_twin_that_makes():
    full = full_plan(repeats=1)
    converted = in_fp32(full.cases)
    assert {c.workload.precision for c in full.cases} == {"bf16", "fp32"}
    assert {c.workload.precision for c in converted} == {"fp32"}
    # the efficiency runs' bf16 gpt2-mini at ZeRO-1 became its fp32 twin's job: only the twin stays
    efficiency = [(c.workload.name, c.strategy.label) for c in converted if c.group == "efficiency"]
    assert efficiency == [("gpt2-mini", "z2"), ("gpt2-mini (fp32)", "z1")]
    assert len(converted) == len(full.cases) - 1
    short = in_fp32(short_plan().cases)
    assert [c.name for c in short] == [c.name for c in short_plan().cases]  # every pair and row stays


def test_rows_pages_and_checks_without_a_bf16_peak(tmp_path):
    peaks = {"bf16": None, "fp32": 0.1, "bf16_not_measured": NO_BF16, "datasheet_bf16": None}
    result = {"case": "t z1 bigtrain", "runner": "bigtrain", "workload": "t", "strategy": "z1", "group": "ratio",
              "ok": True, "world_size": 2, "samples_per_s": 10.0, "step_s_median": 0.4, "flops_per_sample": 1e9,
              "tokens_per_sample": 64, "global_batch": 4, "num_params": 1000, "model_state_bytes_per_rank": [10],
              "peak_rss_per_rank": [100], "losses": [6.0], "split_ms": {}}
    fp32 = make_row({**result, "precision": "fp32"}, peaks)
    bf16 = make_row({**result, "precision": "bf16", "case": "t z1 bigtrain (dry)"}, peaks)
    assert fp32["mfu"] == pytest.approx(0.01 / 0.2) and fp32["mfu_bf16"] is None
    assert bf16["mfu"] is None  # the GPU plan's dry run keeps bf16: no peak to hold it against
    assert check_rows([fp32, bf16], peaks) == []
    assert row_line(bf16, "bf16") == "10.00 samples/s, MFU - (no peak measured) (bf16)"  # the bench's console line
    assert row_line(fp32, "fp32") == "10.00 samples/s, MFU 5.0% (fp32)"
    assert check_rows([fp32], {**peaks, "bf16_not_measured": None}) == ["bf16 peak None is not a positive number"]
    meta = {"mode": "full", "command": "bigtrain bench", "minutes": 1.0, "ranks": 2, "peaks": peaks,
            "env_summary": "x", "host": {"cpu": "AMD EPYC", "cores": 2, "memory_gib": 24, "amx": False,
                                          "avx512_bf16": False, "date": "d"}}
    assert (f"**fp32 0.100 TFLOP/s**; bf16 not measured: {NO_BF16}, so the bf16 workloads trained in fp32."
            in conditions(meta))
    from bigtrain.bench.plots import write_plots
    assert write_plots([fp32], [], tmp_path)  # the MFU plot without a bf16 peak


def test_a_bf16_run_without_native_bf16_holds_mfu_against_the_fp32_peak(monkeypatch, caplog):
    from bigtrain.config.load import load_run_config
    from bigtrain.train import report
    measured = []
    monkeypatch.setattr(torch.distributed, "barrier", lambda: None)
    monkeypatch.setattr(report, "measure_peak_tflops", lambda dtype, seconds: measured.append(dtype) or 0.25)
    monkeypatch.setattr(device, "bf16_not_native", lambda name=None: NO_BF16)
    run = load_run_config(None, ["precision=bf16"])
    with caplog.at_level(logging.INFO, logger="bigtrain"):
        assert report.peak_for_mfu(run, is_main=True) == 0.25
    assert measured == [torch.float32]
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("peak 0.25 TFLOP/s per rank for MFU, measured (fp32 matmul, ")
    assert lines[1] == (f"precision=bf16 here runs its matmuls in software, many times slower than fp32: {NO_BF16} "
                        "(precision=auto picks fp32 on this machine); MFU is against the fp32 peak")
    monkeypatch.setattr(device, "bf16_not_native", lambda name=None: None)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="bigtrain"):
        report.peak_for_mfu(run, is_main=True)
    assert measured[-1] == torch.bfloat16 and len(caplog.records) == 1
    assert report.peak_for_mfu(load_run_config(None, ["precision=bf16", "train.peak_tflops=3"]), False) == 3
    assert measured == [torch.float32, torch.bfloat16]  # a given peak measures nothing
