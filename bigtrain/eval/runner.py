"""One evaluation: lm-eval's `simple_evaluate` on a `RankSplitLM`, its results file, table and scores.

The results are lm-eval's own dict (`results[task]["acc,none"]`, `configs`, `versions`, `n-shot`, ...), as
`lm_eval --output_path` writes it, with a `bigtrain` section saying what was evaluated, on how many ranks, and how
fast. Every rank computes the same results (the ranks share the answers); rank 0 writes and prints them.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

from bigtrain.atomic import write_atomic
from bigtrain.eval.harness import require_lm_eval
from bigtrain.eval.tasks import TaskSet, quiet_lm_eval


def evaluate(lm: Any, tasks: TaskSet, num_fewshot: int | None = None, limit: float | None = None,
             bootstrap_iters: int = 100000, progress: bool = True) -> dict | None:
    """lm-eval's results for `tasks` on `lm`, with `bigtrain.seconds`, `bigtrain.cpu_s` (this process's CPU time)
    and `bigtrain.requests` (request counts by type, from lm's `requests_seen`); None on a rank other than each
    node's first, where lm-eval returns nothing. `bootstrap_iters` 0 skips the bootstrapped standard errors
    (lm-eval's CLI computes them with 100000, the default here too, so that both give the same file). `progress`:
    lm-eval's progress bars (each task's request building; the model's requests follow `lm.progress`)."""
    require_lm_eval()
    from lm_eval import simple_evaluate

    lm.requests_seen.clear()
    started, cpu = time.perf_counter(), time.process_time()
    with quiet_lm_eval(), _bootstrap_in_process(), _quiet_git_hash(), _environment_described_once(), \
            contextlib.nullcontext() if progress else _no_task_bars():
        results = simple_evaluate(model=lm, tasks=list(tasks.names), task_manager=tasks.manager,
                                  num_fewshot=num_fewshot, limit=limit, bootstrap_iters=bootstrap_iters,
                                  log_samples=False)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    if results is None:
        return None
    results.pop("samples", None)
    # cpu_s: this rank's CPU time in the evaluation, which other jobs on a shared machine do not inflate
    results["bigtrain"] = {"seconds": seconds, "cpu_s": cpu, "requests": dict(lm.requests_seen),
                           "requests_per_s": sum(lm.requests_seen.values()) / seconds if seconds > 0 else None}
    return results


@contextlib.contextmanager
def _bootstrap_in_process() -> Iterator[None]:
    """lm-eval's bootstrapped standard errors (perplexities, F1, ...) run in a `multiprocessing.Pool` forked from
    this process, whose torch, gloo and DeepSpeed threads may hold locks at that moment: a forked worker can wait on
    one forever (a CI run hung so, in the pool's queue lock). Its `DISABLE_MULTIPROC` switch runs the same draws in
    one loop, seeded chunk by chunk as the pool's workers are: the same numbers."""
    before = os.environ.get("DISABLE_MULTIPROC")
    os.environ["DISABLE_MULTIPROC"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("DISABLE_MULTIPROC", None)
        else:
            os.environ["DISABLE_MULTIPROC"] = before


@contextlib.contextmanager
def _quiet_git_hash() -> Iterator[None]:
    """lm-eval records the commit of the working directory in its results (`git describe --always`, git's stderr on
    the console): outside a git checkout git prints `fatal: not a git repository` there. The same hash (or lm-eval's
    own fallback, read from a .git folder), without git's complaint."""
    import lm_eval.evaluator as evaluator
    from lm_eval.loggers.utils import get_commit_from_path

    def quiet_hash() -> str | None:
        try:
            found = subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL)
            return found.strip().decode()
        except (subprocess.CalledProcessError, FileNotFoundError):
            return get_commit_from_path(os.getcwd())

    asked = evaluator.get_git_commit_hash
    evaluator.get_git_commit_hash = quiet_hash
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = asked


_ENVIRONMENT: dict[str, Any] = {}  # lm-eval's description of this process's environment, once asked


@contextlib.contextmanager
def _environment_described_once() -> Iterator[None]:
    """lm-eval describes the environment in every results dict (torch's collect_env: `pip list` and a dozen other
    processes, ~0.6 s of wall time), and an evaluation during training asked again at every interval: the process's
    first description serves its later evaluations (the packages, the devices and the commit do not change)."""
    import lm_eval.evaluator as evaluator
    asked = evaluator.add_env_info

    def described_once(storage: dict[str, Any]) -> None:
        if not _ENVIRONMENT:
            asked(_ENVIRONMENT)
        storage.update(_ENVIRONMENT)

    evaluator.add_env_info = described_once
    try:
        yield
    finally:
        evaluator.add_env_info = asked


@contextlib.contextmanager
def _no_task_bars() -> Iterator[None]:
    """lm-eval draws a bar for each task's request building with no switch to turn it off (api/task.py's module
    global `tqdm`): during training, in the middle of the run's log, it is held back for the block."""
    import lm_eval.api.task as task_module
    drawn = task_module.tqdm
    task_module.tqdm = functools.partial(drawn, disable=True)
    try:
        yield
    finally:
        task_module.tqdm = drawn


def scores(results: dict) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} of every finite number in lm-eval's results ("acc,none" -> "acc"; another filter
    than "none" stays in the name, "exact_match,strict-match" -> "exact_match/strict-match"); no standard errors."""
    out: dict[str, dict[str, float]] = {}
    for task, metrics in (results.get("results") or {}).items():
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if not filt or "_stderr" in metric or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                out.setdefault(task, {})[metric if filt == "none" else f"{metric}/{filt}"] = float(value)
    return out


def score_line(task_scores: dict[str, dict[str, float]]) -> str:
    """'sounds_mc acc 0.8333 acc_norm 0.75 | sounds_ppl word_perplexity 12.1' for a log line."""
    return " | ".join(f"{task} " + " ".join(f"{m} {v:.4g}" for m, v in metrics.items())
                      for task, metrics in task_scores.items())


def write_results(results: dict, out: str | Path) -> Path:
    """The results as JSON at `out` (its folder made), atomically: lm-eval's own serialisation of its values."""
    from lm_eval.utils import handle_non_serializable
    path = Path(out).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))


def results_table(results: dict) -> str:
    """lm-eval's console table(s) of the results (tasks, then groups where there are any)."""
    from lm_eval.utils import make_table
    table = make_table(results)
    if results.get("groups"):
        table += "\n" + make_table(results, "groups")
    return table

