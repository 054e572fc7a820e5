"""The largest GPT-2-shaped model that trains a few steps, per strategy, under a memory budget.

Each probe is a real bigtrain job (2 ranks through the launcher) at one depth of a fixed-width
GPT-2 shape. A watchdog sums the resident memory of the job's whole process tree every 0.1 s:
over the budget, the job is killed and the depth "does not fit"; when rank 0 logs the last step
the job is ended there (nothing after training, e.g. the final checkpoint, is part of the
question). The search grows or shrinks the depth from a guess, then bisects.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from bigtrain.bench.cases import Case, Strategy, Workload
from bigtrain.bench.jobs import REPO, command, ds_config_for, job_description, remove_shm_leftovers
from bigtrain.config.presets import MEMORY_LEAN_ZERO3

GIB = 2**30
# Rough bytes per parameter of the whole 2-rank job, to pick the first depth to probe.
GUESS_BYTES_PER_PARAM = {("bf16", 0): 40, ("bf16", 3): 22, ("fp32", 0): 32, ("fp32", 3): 24}
# name -> (strategy, run-config overrides); ZeRO-3 + offload with the offload presets' settings.
STRATEGIES = {"ZeRO-0": (Strategy(zero=0), ()),
              "ZeRO-3 + offload": (Strategy(zero=3, offload="all"),
                                   tuple((f"zero.{k}", str(v)) for k, v in MEMORY_LEAN_ZERO3.items()))}


@dataclass(frozen=True)
class CapacityPlan:
    budget_bytes: int
    n_embd: int = 1024
    n_head: int = 16
    seq_len: int = 128
    micro_batch: int = 1
    precision: str = "bf16"
    steps: int = 3
    max_probes: int = 7  # per strategy
    probe_timeout_s: float = 900.0
    strategies: dict = field(default_factory=lambda: dict(STRATEGIES))

    def workload(self, n_layer: int) -> Workload:
        return Workload(f"gpt2-{n_layer}x{self.n_embd}", "gpt2", "custom",
                        {"n_layer": n_layer, "n_embd": self.n_embd, "n_head": self.n_head}, seq_len=self.seq_len,
                        micro_batch=self.micro_batch, precision=self.precision)

    def num_params(self, n_layer: int) -> int:
        from bigtrain import models
        return models.build("gpt2", "custom", **self.workload(n_layer).spec_kwargs()).num_params

    def guess(self, strategy: Strategy) -> int:
        per_param = GUESS_BYTES_PER_PARAM[(self.precision, 3 if strategy.zero == 3 else 0)]
        usable = max(self.budget_bytes - 3 * GIB, GIB)  # interpreters, libraries, activations
        per_layer = self.num_params(2) - self.num_params(1)
        embeddings = self.num_params(1) - per_layer
        return max(1, int((usable / per_param - embeddings) / per_layer))


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (0 once it is gone)."""
    import psutil
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass
    return total


def watch_job(cmd: list[str], env: dict, log_path: Path, budget: int, done_marker: str,
              timeout_s: float) -> tuple[str, int, float]:
    """Run `cmd` until `done_marker` shows in its log ("fits"), it exceeds `budget` ("over budget"),
    exits ("exited rc N") or times out. Returns (outcome, peak summed RSS, seconds)."""
    start, peak = time.perf_counter(), 0
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        outcome = ""
        while not outcome:
            time.sleep(0.1)
            peak = max(peak, tree_rss(proc.pid))
            if peak > budget:
                outcome = "over budget"
            elif done_marker in log_path.read_text(errors="replace")[-20000:]:
                outcome = "fits"
            elif proc.poll() is not None:
                outcome = "fits" if done_marker in log_path.read_text(errors="replace") else f"exited rc {proc.returncode}"
            elif time.perf_counter() - start > timeout_s:
                outcome = "timed out"
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return outcome, peak, time.perf_counter() - start


def probe(plan: CapacityPlan, name: str, strategy: Strategy, n_layer: int, workdir: Path, env: dict,
          sets: tuple[tuple[str, str], ...] = ()) -> dict:
    """One real job at depth `n_layer`; {'fits': bool, 'peak_bytes', 'outcome', ...}."""
    from bigtrain.distributed.rendezvous import free_port
    case = Case(plan.workload(n_layer), strategy, steps=plan.steps, group="capacity", sets=sets)
    out = Path(workdir) / f"capacity-{case.slug}"
    out.mkdir(parents=True, exist_ok=True)
    ds_config = ds_config_for(case, 2)
    ds_path, job_path = out / "ds_config.json", out / "job.json"
    ds_path.write_text(json.dumps(ds_config))
    job_path.write_text(json.dumps(job_description(case, ds_config)))
    port = free_port()
    cmd, launcher_vars = command(case, out, ds_path, job_path, port, 2, peak_tflops=1.0)
    cmd += ["--set", "logging.interval=1", "--set", f"checkpoint.dir={out / 'ckpt'}"]
    try:
        outcome, peak, seconds = watch_job(cmd, {**env, **launcher_vars, "PYTHONPATH": str(REPO)}, out / "log.txt",
                                           plan.budget_bytes, f"step {plan.steps}/{plan.steps} ", plan.probe_timeout_s)
    finally:
        remove_shm_leftovers(port)
    return {"strategy": name, "n_layer": n_layer, "label": f"{n_layer} x {plan.n_embd}",
            "num_params": plan.num_params(n_layer), "fits": outcome == "fits", "outcome": outcome,
            "why": outcome, "peak_bytes": peak, "seconds": round(seconds, 1)}


def search_depth(fits: Callable[[int], bool], guess: int, max_probes: int) -> tuple[int | None, int | None]:
    """(largest depth that fits, smallest that does not) from a guess: grow x1.5 / halve, then bisect."""
    ok, bad, n = None, None, max(1, guess)
    for _ in range(max_probes):
        if fits(n):
            ok = n
        else:
            bad = n
        if bad is not None and ok is not None and bad - ok <= 1:
            break
        if bad is None:
            n = max(n + 1, int(n * 1.5))
        elif ok is None:
            if n == 1:
                break
            n = max(1, n // 2)
        else:
            n = (ok + bad) // 2
    return ok, bad


def search_capacity(plan: CapacityPlan, workdir: Path, env: dict, log: Callable[[str], None] = print) -> dict:
    """Largest depth per strategy, every probe, and the parameter ratio of the last strategy over the first."""
    probes: list[dict] = []
    found: dict[str, dict] = {}
    for name, (strategy, sets) in plan.strategies.items():
        mine: dict[int, dict] = {}

        def fits(n: int, name: str = name, strategy: Strategy = strategy, sets: tuple = sets, mine: dict = mine) -> bool:
            result = probe(plan, name, strategy, n, workdir, env, sets)
            mine[n] = result
            probes.append(result)
            log(f"capacity {name} n_layer={n} ({result['num_params'] / 1e6:.0f}M): {result['outcome']}, "
                f"peak {result['peak_bytes'] / GIB:.1f} GiB, {result['seconds']:.0f} s")
            return result["fits"]

        ok, bad = search_depth(fits, plan.guess(strategy), plan.max_probes)
        found[name] = {"largest": mine.get(ok) if ok else None, "smallest_failing": mine.get(bad) if bad else None}
    names = list(found)
    first, last = found[names[0]]["largest"], found[names[-1]]["largest"]
    ratio = last["num_params"] / first["num_params"] if first and last else None
    return {"budget_bytes": plan.budget_bytes, "ranks": 2, "precision": plan.precision,
            "micro_batch": plan.micro_batch, "seq_len": plan.seq_len, "steps": plan.steps,
            "shape_rule": f"n_layer x {plan.n_embd} (n_head {plan.n_head}, vocab 50257)",
            "strategies": found, "ratio": ratio, "probes": probes,
            "settings": {name: dict(sets) for name, (_, sets) in plan.strategies.items() if sets}}


def default_budget(requested_gib: float | None = None, reserve_gib: float = 1.5) -> int:
    """The budget: the requested size, but never more than what is free now minus a reserve
    (other work on the machine must not be pushed into the kernel's OOM killer)."""
    import psutil
    available = psutil.virtual_memory().available - int(reserve_gib * GIB)
    wanted = int(requested_gib * GIB) if requested_gib else available
    return max(GIB, min(wanted, available))
