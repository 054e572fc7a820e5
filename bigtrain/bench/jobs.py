"""Launch one benchmark job as `bigtrain train` would and read back what it measured.

All three runners get the same DeepSpeed JSON (generated from the case's run config, with
DeepSpeed's wall-clock breakdown on), the same environment and the same launcher. The result
is a flat dict with the same keys whichever runner produced it.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bigtrain.bench.cases import PROMPTS_FILE, Case
from bigtrain.bench.timers import step_split

if TYPE_CHECKING:
    from bigtrain.ds.lint import DeviceCaps

REPO = Path(__file__).resolve().parents[2]
MONITOR_KEYS = ("tensorboard", "csv_monitor", "wandb", "comet")
MODULES = {"deepspeed": "bigtrain.bench.baseline_deepspeed", "ddp": "bigtrain.bench.baseline_ddp",
           "nanogpt": "bigtrain.bench.baseline_nanogpt"}


@dataclass(frozen=True)
class Launch:
    """How jobs start: ranks, environment, time limit."""

    env: dict
    num_ranks: int = 2
    timeout_s: float = 900.0
    # DeepSpeed's wall-clock breakdown (the fwd / bwd / step split): free on a CPU, where its timers are host
    # clocks; on a GPU it synchronizes every phase, so measured GPU jobs run without it.
    breakdown: bool = True


def ds_config_for(case: Case, num_ranks: int, breakdown: bool = True, device: DeviceCaps | None = None) -> dict:
    """The DeepSpeed dict bigtrain would generate for this case, monitors left out, the case's own DeepSpeed
    keys set, DeepSpeed's timers on (`breakdown`); for this machine's accelerator, or `device`."""
    from bigtrain.config.load import field_sources, load_run_config
    from bigtrain.ds.resolve import resolve
    run = load_run_config(None, case.run_overrides())
    config = resolve(run, None, num_ranks, device, sources=field_sources(None, case.run_overrides())).ds_config
    for key in MONITOR_KEYS:
        config.pop(key, None)
    # DeepSpeed 0.19.8's pipeline engine fails with the breakdown on ("bwd_microstep timer has
    # already been started"): pipeline rows have no forward/backward/step split.
    config["wall_clock_breakdown"] = breakdown and case.strategy.pipeline == 1
    for key, value in case.ds_sets:
        *path, last = key.split(".")
        node = config
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return config


def job_description(case: Case, ds_config: dict) -> dict:
    """What a baseline needs to build the same model and data as bigtrain."""
    w = case.workload
    opt = ds_config["optimizer"]["params"]
    return {"family": w.family, "modality": w.modality, "size": w.size, "spec_kwargs": w.spec_kwargs(),
            "seq_len": w.seq_len,
            "vocab_size": w.vocab_size, "image_size": w.image_size, "num_classes": w.num_classes,
            "synthetic_samples": 4096, "seed": 1234, "steps": case.steps, "micro_batch": w.micro_batch,
            "precision": w.precision, "grad_clip": ds_config.get("gradient_clipping", 1.0),
            "optimizer": {k: opt[k] for k in ("lr", "betas", "eps", "weight_decay")}}


def command(case: Case, out: Path, ds_path: Path, job_path: Path, port: int, num_ranks: int,
            peak_tflops: float | None) -> tuple[list[str], dict[str, str]]:
    """Every runner's job as `bigtrain train` starts one machine's ranks (`bigtrain.launch.node.machine_command`:
    DeepSpeed's per-node launcher for several, the rank alone for one), and the variables it adds."""
    from bigtrain.launch.node import machine_command
    if case.runner == "bigtrain":
        args = [str(REPO / "bigtrain" / "run.py"), "--out", str(out), "--deepspeed_config", str(ds_path)]
        if peak_tflops:
            args += ["--peak-tflops", f"{peak_tflops:.6g}"]
        for item in case.run_overrides(out):
            args += ["--set", item]
        return machine_command(num_ranks, port, args)
    args = [MODULES[case.runner], "--job", str(job_path), "--out", str(out)]
    if case.runner == "deepspeed":
        args += ["--ds-config", str(ds_path)]
    return machine_command(num_ranks, port, args, module=True)


def run_case(case: Case, workdir: Path, launch: Launch, peak_tflops: float | None = None) -> dict:
    """Run `case` under `workdir/<slug>`; returns the normalized result (ok=False with the log tail on failure)."""
    from bigtrain.distributed.rendezvous import free_port
    out = Path(workdir) / case.slug
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    ds_config = ds_config_for(case, launch.num_ranks, launch.breakdown)
    ds_path, job_path = out / "ds_config.json", out / "job.json"
    if case.prompts:
        from bigtrain.bench.online import write_prompts
        write_prompts(out / PROMPTS_FILE, case.prompts)
    ds_path.write_text(json.dumps(ds_config, indent=2))
    job_path.write_text(json.dumps(job_description(case, ds_config), indent=2))
    port = free_port()
    cmd, launcher_vars = command(case, out, ds_path, job_path, port, launch.num_ranks, peak_tflops)
    env = {**launch.env, **dict(case.env), **launcher_vars,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), launch.env.get("PYTHONPATH")]))}
    try:
        rc, log, wall = _run(cmd, env, launch.timeout_s, out / "log.txt")
    finally:
        remove_shm_leftovers(port)
    result = {"case": case.name, "runner": case.runner, "workload": case.workload.name,
              "strategy": case.strategy.label, "group": case.group, "precision": case.workload.precision,
              "setting": case.setting or "bigtrain's defaults", "base_workload": case.base or case.workload.name,
              "rc": rc, "wall_s": wall}
    try:
        measured = read_bigtrain(out) if case.runner == "bigtrain" else read_baseline(out)
    except (OSError, ValueError, KeyError) as err:
        return {**result, "ok": False, "error": f"{type(err).__name__}: {err}", "log_tail": log[-3000:]}
    return {**result, **measured, "ok": rc == 0, "split_ms": step_split(log), "log_tail": "" if rc == 0 else log[-3000:]}


def _run(cmd: list[str], env: dict, timeout_s: float, log_path: Path) -> tuple[int, str, float]:
    """Run in a session of its own so a timeout ends the launcher and every rank; the log streams to a file."""
    start = time.perf_counter()
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            log_file.write(f"\n[bench] killed after {timeout_s:.0f} s\n")
            rc = 124
    return rc, log_path.read_text(errors="replace"), time.perf_counter() - start


def remove_shm_leftovers(port: int) -> int:
    """Unlink the /dev/shm all-reduce buffers DeepSpeed's CPU backend left for the job on `port`
    (the baselines and killed jobs do not release them; see distributed.release_shm_buffer)."""
    removed = 0
    for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
        try:
            path.unlink()
            removed += 1
        except OSError:
            pass
    return removed


def read_bigtrain(out: Path) -> dict[str, Any]:
    s = json.loads((out / "summary.json").read_text())
    model = s["model"]
    online = {}
    if "time_split" in s:  # an online objective: the step's parts, generation tokens/s
        from bigtrain.bench.online import step_medians
        online = {"online": step_medians(s)}
    return {**online, "samples_per_s": s["samples_per_s"], "step_s_median": s["step_s_median"], "losses": s["losses"],
            "num_params": model["num_params"], "flops_per_sample": model["flops_per_sample"],
            "tokens_per_sample": model["tokens_per_sample"], "global_batch": s["ds_config"]["train_batch_size"],
            "peak_rss_per_rank": [m.get("peak_device_bytes", m["peak_rss_bytes"]) for m in s["peak_memory_per_rank"]],
            "model_state_bytes_per_rank": s["model_state_bytes_per_rank"], "world_size": s["world_size"]}


def read_baseline(out: Path) -> dict[str, Any]:
    ranks = [json.loads(f.read_text()) for f in sorted(out.glob("result_rank*.json"))]
    if not ranks:
        raise ValueError(f"no result_rank*.json in {out}")
    r0 = ranks[0]  # rank 0's clock, as bigtrain reports rank 0's
    return {"samples_per_s": r0["samples_per_s"], "step_s_median": r0["step_s_median"], "losses": r0["losses"],
            "num_params": r0["num_params"], "flops_per_sample": r0["flops_per_sample"],
            "tokens_per_sample": r0["tokens_per_sample"], "global_batch": r0["global_batch"],
            "peak_rss_per_rank": [r["peak_memory"].get("peak_device_bytes", r["peak_memory"]["peak_rss_bytes"])
                                  for r in ranks],
            "model_state_bytes_per_rank": [r["model_state_bytes"] for r in ranks], "world_size": len(ranks)}
