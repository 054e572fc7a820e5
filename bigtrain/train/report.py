"""What a run tells its user: the per-step log line, progress bar, monitors and summary.json."""
from __future__ import annotations

import json
import logging
import math
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import torch

from bigtrain.atomic import write_atomic
from bigtrain.config.run_config import RunConfig
from bigtrain.distributed.world import World
from bigtrain.metrics import (MetricsLogger, ProgressBar, ThroughputMeter, achieved_tflops, measure_peak_tflops,
                              memory_per_rank_bytes, memory_report, mfu, peak_memory)
from bigtrain.metrics.samples import SampleLog
from bigtrain.models.spec import ModelSpec

log = logging.getLogger("bigtrain")
PRECISION_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
Listener = Callable[[str, int, dict], None]
_listeners: list[Listener] = []


def add_listener(listener: Listener) -> Callable[[], None]:
    """Also send the run's events to `listener(event, step, values)`: "log" (the metrics of a log
    step), "eval" ({"val_loss", "val_ppl"}, and "eval/TASK/METRIC" with train.eval_tasks) and
    "checkpoint" ({"path"}), on every rank at the same steps. How Ray Train and Ray Tune hear of a
    run (launch/ray_train.py); returns the remover."""
    _listeners.append(listener)
    return lambda: _listeners.remove(listener)


def notify(event: str, step: int, values: dict) -> None:
    for listener in list(_listeners):
        listener(event, step, values)


def write_summary(out: Path, summary: dict) -> Path:
    """OUT/summary.json, atomically: a reader (a sweep, a resumed job, a kill mid-write) sees the old
    file or the new one, never half of one."""
    return write_atomic(Path(out) / "summary.json", json.dumps(finite_or_null(summary), indent=2, allow_nan=False))


def finite_or_null(value: Any) -> Any:
    """NaN and infinities as null: strict JSON has no spelling for them (a diverged run's losses hold them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


def time_split(metrics: dict[str, list[tuple[int, float]]]) -> dict[str, dict[str, float]]:
    """An objective's `time/PART` metrics (the seconds of each step spent in PART) as each part's mean seconds per
    step and its share of their sum, over every step recorded."""
    means = {name.removeprefix("time/"): statistics.fmean(v for _, v in values)
             for name, values in metrics.items() if name.startswith("time/") and values}
    total = sum(means.values())
    return {part: {"mean_s": mean, "share": mean / total if total > 0 else 0.0} for part, mean in means.items()}


def objective_line(metrics: dict[str, float]) -> str:
    """The objective's metrics of a log step; its `time/PART` ones last, as seconds and shares of the step."""
    shown = [f"{k} {v:.4f}" for k, v in metrics.items() if not k.startswith("time/")]
    parts = {k.removeprefix("time/"): v for k, v in metrics.items() if k.startswith("time/")}
    total = sum(parts.values())
    if parts:
        shown.append("time " + " ".join(f"{part} {s:.2f}s" + (f" ({s / total:.0%})" if total > 0 else "")
                                        for part, s in parts.items()))
    return " | ".join(shown)


PEAK_SECONDS = 0.25  # how long each rank measures its matmul peak before the first step (train.peak_tflops: none)


def peak_for_mfu(run: RunConfig, is_main: bool) -> float:
    """The per-rank peak TFLOP/s that MFU is against: `train.peak_tflops`, else measured now by every rank at once
    in the run's precision; fp32's where the device has no native bf16 (a bf16 rate computed in software is no
    bound a model could reach), which the line says."""
    if run.train.peak_tflops:
        if is_main:
            log.info("peak %.2f TFLOP/s per rank for MFU, given", run.train.peak_tflops)
        return run.train.peak_tflops
    from bigtrain.distributed.device import bf16_not_native
    why = bf16_not_native() if run.precision == "bf16" else None
    precision = "fp32" if why else run.precision
    torch.distributed.barrier()  # all ranks measure at once, as they will train: shared cores
    # a quarter second: the best rate of a 1024^3 fp32 product came within 2% of a whole second's (2-core EPYC),
    # and it is time before the first step
    peak = measure_peak_tflops(PRECISION_DTYPE[precision], seconds=PEAK_SECONDS)
    if is_main:
        log.info("peak %.2f TFLOP/s per rank for MFU, measured (%s matmul, %d threads, %g s: it varies with what "
                 "else runs on the machine; --peak-tflops fixes it to compare MFU across runs)", peak, precision,
                 torch.get_num_threads(), PEAK_SECONDS)
        if why:
            log.warning("precision=bf16 here runs its matmuls in software, many times slower than fp32: %s "
                        "(precision=auto picks fp32 on this machine); MFU is against the fp32 peak", why)
    return peak


class Reporter:
    """Rank 0 talks; every rank measures (the summary gathers per-rank memory)."""

    def __init__(self, run: RunConfig, spec: ModelSpec, ds_config: dict, engine: Any, world: World, out: Path,
                 prior: Any = None):
        """`prior`: the checkpoint state a resumed run continues (its losses and curves; None: a fresh run)."""
        self.engine, self.world, self.spec = engine, world, spec
        self.total_steps = run.train.steps
        self.interval = run.logging.interval
        self.global_batch = ds_config["train_batch_size"]
        history = prior.history if prior is not None else {}
        self.losses: list[float] = list(prior.losses) if prior is not None else []
        self.val_losses: list[tuple[int, float]] = [tuple(x) for x in history.get("val_losses", [])]
        self.val_accuracies: list[tuple[int, float]] = [tuple(x) for x in history.get("val_accuracies", [])]
        self.router_losses: list[tuple[int, float]] = [tuple(x) for x in history.get("router_aux_losses", [])]
        # the objective's other metrics per step (DPO's rewards/..., ...) and at each evaluation
        self.metrics: dict[str, list[tuple[int, float]]] = {k: [tuple(x) for x in v]
                                                            for k, v in history.get("metrics", {}).items()}
        self.val_metrics: dict[str, list[tuple[int, float]]] = {k: [tuple(x) for x in v]
                                                                for k, v in history.get("val_metrics", {}).items()}
        self.task_scores: list[tuple[int, dict]] = [tuple(x) for x in history.get("eval_tasks", [])]
        self.prior_wall_s = float(history.get("wall_s", 0.0))  # the earlier processes' share of the run
        self.first_step = prior.step + 1 if prior is not None else 1
        self.logged_step = self.first_step - 1  # the last log step: the objective's metrics are averaged since it
        self.meter = ThroughputMeter(warmup=2)
        self.peak_tflops = peak_for_mfu(run, world.is_main)
        self.monitor = MetricsLogger(monitor=getattr(engine.ds, "monitor", None), run_config=asdict(run))
        if prior is not None:
            self.monitor.continue_from(prior.step, prior.step * self.global_batch)
        self.samples = SampleLog(out, self.monitor, prior.step if prior is not None else None) \
            if world.is_main else None
        self.bar = ProgressBar(run.train.steps, enabled=world.is_main, log_every=self.interval)
        if not run.logging.progress_bar:
            self.bar.tty = False  # plain log lines every interval instead of a redrawn bar
        self.started = time.perf_counter()
        self.lrs: list[float] = []  # this process's steps: the rate each applied
        self.grad_norms: list[float] = []  # ... and each one's gradient norm before clipping, where known
        self.first_step_end_unix: float | None = None  # when this process's first step ended (time.time())
        self.step_end_cpu: list[float] = []  # this process's CPU seconds at each step's end (time.process_time())

    def history(self) -> dict:
        """The curves and run time so far, for a checkpoint (a resume continues them)."""
        return {"val_losses": [list(x) for x in self.val_losses],
                "val_accuracies": [list(x) for x in self.val_accuracies],
                "router_aux_losses": [list(x) for x in self.router_losses],
                "metrics": {k: [list(x) for x in v] for k, v in self.metrics.items()},
                "val_metrics": {k: [list(x) for x in v] for k, v in self.val_metrics.items()},
                "eval_tasks": [list(x) for x in self.task_scores],
                "wall_s": self.prior_wall_s + time.perf_counter() - self.started}

    def clock_restart(self) -> None:
        """Start the step clock (again): before the first step, and after eval or a checkpoint."""
        self.meter.start()

    def on_step(self, step: int, loss: float, lr: float, objective_metrics: dict[str, float] | None = None) -> None:
        """`objective_metrics`: the objective's, averaged over the ranks (`router_aux_loss`: a mixture of experts'
        load-balancing loss, part of `loss` weighted by its coefficient; DPO's rewards/..., ...). The log line and
        the monitors show each one's mean over the steps since the last log step (as TRL's trainers log them), the
        summary every step's."""
        objective_metrics = dict(objective_metrics or {})
        tokens = self.global_batch * self.spec.tokens_per_sample
        self.meter.step(self.global_batch, tokens)
        self.losses.append(loss)
        self.lrs.append(lr)
        self.step_end_cpu.append(time.process_time())
        if self.first_step_end_unix is None:
            self.first_step_end_unix = time.time()
        router_loss = objective_metrics.pop("router_aux_loss", None)
        grad_norm = objective_metrics.pop("grad_norm", None)  # the stepper's, on the step's own line
        if grad_norm is not None:
            self.grad_norms.append(grad_norm)
        if router_loss is not None:
            self.router_losses.append((step, router_loss))
        for name, value in objective_metrics.items():
            self.metrics.setdefault(name, []).append((step, value))
        self.bar.tick(step)  # a terminal's bar moves every step; the fields change at log steps
        if step % self.interval and step != self.total_steps:
            return
        objective_metrics = {name: statistics.fmean(v for s, v in self.metrics[name] if s > self.logged_step)
                             for name in objective_metrics}
        self.logged_step = step
        metrics = {**self._window_metrics(loss, lr), **objective_metrics}
        if grad_norm is not None:
            metrics["grad_norm"] = grad_norm
        if router_loss is not None:
            metrics["router_aux_loss"] = router_loss
            if self.world.is_main:
                self.bar.write(f"step {step}: router load-balancing loss {router_loss:.4f}")
        if objective_metrics and self.world.is_main:
            self.bar.write(f"step {step}: " + objective_line(objective_metrics))
        table = getattr(self.engine.objective, "sample_table", lambda: None)()
        if table and self.samples is not None:
            self.samples.write(step, table)
        warning = getattr(self.engine.objective, "window_warning", lambda: None)()
        if warning and self.world.is_main:
            log.warning("warning: %s", warning)
        self.monitor.log(step, metrics)
        notify("log", step, metrics)
        if self.world.is_main:
            self.bar.update(step, loss=loss, lr=lr, grad_norm=grad_norm, tokens_per_s=metrics.get("tokens_per_s"),
                            samples_per_s=metrics["samples_per_s"], tflops=metrics["tflops"], mfu=metrics["mfu"],
                            mem_bytes=metrics["mem_bytes"])

    def on_eval(self, step: int, val_loss: float | None, tasks: dict[str, dict[str, float]] | None = None) -> None:
        """Classifiers report accuracy (the engine's `last_eval_accuracy`), language models perplexity, a preference
        objective its held-out metrics (the engine's `last_eval_metrics`: rewards/..., by TRL's names); `tasks`:
        lm-eval scores {task: {metric: value}} (train.eval_tasks), monitored as eval/TASK/METRIC. `val_loss` is
        None when only the tasks ran (train.eval_batches=0)."""
        metrics: dict[str, float] = {}
        shown = []
        if val_loss is not None:
            self.val_losses.append((step, val_loss))
            objective = dict(getattr(self.engine, "last_eval_metrics", {}) or {})
            for name, value in objective.items():
                self.val_metrics.setdefault(name, []).append((step, value))
            if objective:  # a pair objective's loss is no log-likelihood to take a perplexity of
                metrics = {"val_loss": val_loss, **{f"val_{k}": v for k, v in objective.items()}}
                shown = [" | ".join(f"val_{k} {v:.4f}" for k, v in objective.items())]  # as the monitors name them
                if "accuracy" in objective and self.spec.eval_metric == "accuracy":  # a reward model's pairs
                    self.val_accuracies.append((step, objective["accuracy"]))
            elif self.spec.eval_metric == "accuracy":
                acc = float(getattr(self.engine, "last_eval_accuracy", float("nan")))
                self.val_accuracies.append((step, acc))
                metrics, shown = {"val_loss": val_loss, "val_accuracy": acc}, [f"accuracy {acc:.4f}"]
            else:
                ppl = math.exp(val_loss) if val_loss < 50 else float("inf")
                metrics, shown = {"val_loss": val_loss, "val_ppl": ppl}, [f"ppl {ppl:.2f}"]
            shown.insert(0, f"val loss {val_loss:.4f}")
        if tasks:
            from bigtrain.eval.runner import score_line
            self.task_scores.append((step, tasks))
            metrics.update({f"eval/{task}/{name}": value for task, values in tasks.items()
                            for name, value in values.items()})
            shown.append(score_line(tasks))
        self.monitor.log(step, metrics)
        notify("eval", step, metrics)
        if self.world.is_main:
            self.bar.write(f"eval step {step}: {' | '.join(shown)}")

    def _window_metrics(self, loss: float, lr: float) -> dict[str, float]:
        recent = self.meter.times[-self.interval:]
        step_s = statistics.median(recent) if recent else float("nan")
        samples_per_s = self.global_batch / step_s
        metrics = {"loss": loss, "lr": lr, "samples_per_s": samples_per_s, "step_s": step_s,
                   "tflops": achieved_tflops(self.spec.flops_per_sample, samples_per_s),
                   "mfu": mfu(self.spec.flops_per_sample, samples_per_s, self.peak_tflops, self.world.size),
                   "mem_bytes": float(memory_per_rank_bytes(peak_memory()))}
        if self.spec.tokens_per_sample:
            metrics["tokens_per_s"] = samples_per_s * self.spec.tokens_per_sample
        return metrics

    def summary(self, result: Any, **extra: Any) -> dict:
        """Collective (gathers every rank's memory). Rates are medians over steps after a 2-step warm-up."""
        samples_per_s = self.meter.samples_per_s()
        reference = getattr(self.engine.policy.reference, "ds", None)  # a frozen copy (objective.reference)
        per_rank = {"peak_memory": peak_memory(), "model_state": memory_report(self.engine.ds),
                    "reference": memory_report(reference)["model_state_bytes"] if reference is not None else None}
        gathered: list[Any] = [None] * self.world.size
        torch.distributed.all_gather_object(gathered, per_rank)
        self.bar.close()
        self.monitor.flush()
        summary = {
            "steps": result.last_step, "stopped_by": result.stopped_by, "diverged": result.diverged or None, "final_loss": self.losses[-1] if self.losses else None,
            "losses": self.losses, "val_losses": [[s, v] for s, v in self.val_losses],
            "samples_per_s": samples_per_s, "step_s_median": self.meter.median_step_s(),
            "tflops": achieved_tflops(self.spec.flops_per_sample, samples_per_s),
            "mfu": mfu(self.spec.flops_per_sample, samples_per_s, self.peak_tflops, self.world.size),
            "peak_tflops_per_rank": self.peak_tflops, "world_size": self.world.size,
            "peak_memory_per_rank": [g["peak_memory"] for g in gathered],
            "model_state_bytes_per_rank": [g["model_state"]["model_state_bytes"] for g in gathered],
            **({"reference_state_bytes_per_rank": [g["reference"] for g in gathered]}
               if gathered[0]["reference"] is not None else {}),
            "model": {"family": self.spec.family, "size": self.spec.size, "num_params": self.spec.num_params,
                      "flops_per_sample": self.spec.flops_per_sample, "tokens_per_sample": self.spec.tokens_per_sample},
            # the run's seconds over every process that trained it; the rates above are this process's steps
            "wall_s": self.prior_wall_s + time.perf_counter() - self.started,
            "rates_from_step": self.first_step,
            # this process's steps, from rates_from_step on: each one's seconds (the first from the clock's start
            # before it), the rate it applied, its gradient norm, when the first ended (`bigtrain bench --trl`: time to
            # first step) and the process's CPU seconds at each step's end (on a shared machine a steadier account of
            # the work)
            "step_times": list(self.meter.times), "lrs": self.lrs, "grad_norms": self.grad_norms,
            "first_step_end_unix": self.first_step_end_unix, "step_end_cpu_s": self.step_end_cpu,
        }
        if self.spec.tokens_per_sample:
            summary["tokens_per_s"] = samples_per_s * self.spec.tokens_per_sample
        if self.router_losses:
            summary["router_aux_losses"] = [[s, v] for s, v in self.router_losses]
        if self.metrics:  # the objective's, by TRL's names for the preference objectives
            summary["metrics"] = {k: [[s, v] for s, v in values] for k, values in self.metrics.items()}
            summary["final_metrics"] = {k: values[-1][1] for k, values in self.metrics.items()}
            if split := time_split(self.metrics):
                summary["time_split"] = split
        if self.val_metrics:
            summary["val_metrics"] = {k: [[s, v] for s, v in values] for k, values in self.val_metrics.items()}
        if self.task_scores:  # train.eval_tasks: [[step, {task: {metric: value}}], ...] and the last evaluation's
            summary["eval_tasks"] = [[s, v] for s, v in self.task_scores]
            summary["final_eval_tasks"] = self.task_scores[-1][1]
        if self.spec.eval_metric == "accuracy":
            summary["val_accuracies"] = [[s, a] for s, a in self.val_accuracies]
            summary["final_val_accuracy"] = self.val_accuracies[-1][1] if self.val_accuracies else None
        return {**summary, **extra}
