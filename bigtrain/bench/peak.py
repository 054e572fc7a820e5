"""The bf16 and fp32 matmul peak per rank, measured the way the ranks run.

Launched like a training job (same launcher, ranks, threads, binding, malloc settings), every
rank times square matmuls at the same moment as the others, so the peak includes whatever
two busy cores share (memory bandwidth, turbo). A rank's peak is the best of a few sizes;
the per-rank peak is the best any rank reached (see `read_peaks`).

    deepspeed --num_gpus 2 --module bigtrain.bench.peak --out DIR
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

DTYPES = ("bf16", "fp32")


def sizes_for(device_name: str) -> tuple[int, ...]:
    """Square sizes that keep a CPU core busy for milliseconds and fill a GPU's matrix units."""
    return (1024, 2048) if device_name == "cpu" else (4096, 8192)


def measure(seconds: float) -> dict:
    """This rank's best TFLOP/s per dtype over `sizes_for` its device, each size timed while every rank times it.
    bf16 only where the device multiplies it natively: elsewhere it is None, and `bf16_not_measured` says why."""
    import torch
    from deepspeed.accelerator import get_accelerator

    from bigtrain.distributed.device import bf16_not_native
    from bigtrain.distributed.world import barrier
    from bigtrain.metrics import measure_peak_tflops
    device_name = get_accelerator().device_name()
    best: dict = {}
    why = bf16_not_native(device_name)
    if why:  # software bf16: ~2.6 s a 1024^3 product, ~21 s a 2048^3 one, against fp32's 0.085 s
        best["bf16"], best["bf16_not_measured"] = None, why
    for dtype in [d for d in DTYPES if d not in best]:
        rates = []
        for n in sizes_for(device_name):
            barrier()  # all ranks multiply at once, as they train at once
            rates.append(measure_peak_tflops(dtype, size=n, seconds=seconds))
        best[dtype] = max(rates)
    best["threads"] = torch.get_num_threads()
    best["sizes"] = list(sizes_for(device_name))
    best["device"] = device_model(device_name)
    return best


def device_model(device_name: str) -> str:
    """`NVIDIA H100 80GB HBM3` for cuda (what torch's device module reports), else the accelerator's name."""
    import torch
    module = getattr(torch, device_name, None)
    get_name = getattr(module, "get_device_name", None) if device_name != "cpu" else None
    return get_name() if callable(get_name) else device_name


# Dense bf16 tensor-core TFLOP/s from NVIDIA's datasheets (the sparse figures halved), matched in order
# against the name torch reports. MFU against these is what papers and llm.c / nanoGPT quote.
DATASHEET_BF16_TFLOPS = (
    (r"H100.*PCIe", 756.0),
    (r"H100 NVL", 835.0),
    (r"H200 NVL", 835.0),
    (r"H200", 989.0),
    (r"H100", 989.0),  # SXM ("NVIDIA H100 80GB HBM3")
    (r"A100", 312.0),
    (r"L40S", 362.0),
    (r"\bL4\b", 121.0),
    (r"\bA10\b", 125.0),
)


def datasheet_bf16_tflops(device: str) -> float | None:
    """The datasheet's dense bf16 peak for a device name such as "NVIDIA H100 80GB HBM3"; None if not listed."""
    import re
    for pattern, tflops in DATASHEET_BF16_TFLOPS:
        if re.search(pattern, device):
            return tflops
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--seconds", type=float, default=1.0, help="timing window per dtype and size")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from bigtrain.distributed.world import init_distributed, shutdown
    world = init_distributed()
    result = {"rank": world.rank, "affinity": sorted(os.sched_getaffinity(0)), **measure(args.seconds)}
    if world.is_main and result.get("bf16_not_measured"):
        print(f"bf16 peak not measured: {result['bf16_not_measured']}", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"peak_rank{world.rank}.json").write_text(json.dumps(result))
    shutdown()
    return 0


def read_peaks(*outs: Path) -> dict:
    """{'bf16': TFLOP/s per rank, 'fp32': ..., 'per_rank': [...]} from the ranks' files of one or more peak jobs;
    'bf16' None and 'bf16_not_measured' the reason where the device has no native bf16.

    The peak is the best rate any rank reached: the cores are alike, and other work on the host
    only ever lowers a measurement, so the best one is the closest to what the hardware gives.
    """
    ranks = [json.loads(f.read_text()) for out in outs for f in sorted(Path(out).glob("peak_rank*.json"))]
    if not ranks:
        raise RuntimeError(f"the peak job wrote nothing in {', '.join(map(str, outs))}")
    peaks = {d: max((r[d] for r in ranks if r.get(d) is not None), default=None) for d in DTYPES}
    why = next((r["bf16_not_measured"] for r in ranks if r.get("bf16_not_measured")), None)
    return {**peaks, "per_rank": ranks, **({"bf16_not_measured": why} if why else {})}


if __name__ == "__main__":
    sys.exit(main())
