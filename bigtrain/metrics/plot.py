"""loss.png: training and validation loss against step (tokens on a second axis), and `bigtrain plot`.

A run with train.eval_tasks gets a second panel below: each lm-eval task score (acc, perplexity, ...) against step.

Every run writes `OUT/loss.png` beside `summary.json`; `bigtrain plot RUN [RUN ...] --out F`
overlays runs from their summary.json files. matplotlib (the `[bench]` extra) is imported only
here and only when drawing: without it the run says so in one line and goes on.
"""
from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from bigtrain.atomic import replacing

log = logging.getLogger("bigtrain")
MISSING = "matplotlib is not installed (pip install 'bigtrain[bench]')"


@dataclass(frozen=True)
class LossCurve:
    """One run's curves, read from its summary.json."""

    label: str
    steps: list[int]
    losses: list[float]
    val_steps: list[int]
    val_losses: list[float]
    per_step: float  # tokens (or samples, for models without tokens) per optimizer step
    unit: str  # "tokens" or "samples"
    tasks: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # "task metric" -> [(step, score)]

    @classmethod
    def from_summary(cls, summary: dict, label: str = "") -> LossCurve:
        losses = [float(x) for x in summary.get("losses") or []]
        last = int(summary.get("steps") or len(losses))
        steps = list(range(last - len(losses) + 1, last + 1))
        val = [(int(s), float(v)) for s, v in summary.get("val_losses") or []]
        batch = (summary.get("ds_config") or {}).get("train_batch_size") or 0
        tokens = (summary.get("model") or {}).get("tokens_per_sample") or 0
        tasks: dict[str, list[tuple[int, float]]] = {}
        for step, scores in summary.get("eval_tasks") or []:  # train.eval_tasks: [[step, {task: {metric: v}}]]
            for task, metrics in scores.items():
                for metric, value in metrics.items():
                    tasks.setdefault(f"{task} {metric}", []).append((int(step), float(value)))
        return cls(label=label, steps=steps, losses=losses, val_steps=[s for s, _ in val],
                   val_losses=[v for _, v in val], per_step=float(batch * (tokens or 1)),
                   unit="tokens" if tokens else "samples", tasks=tasks)


def read_run(run: str | Path) -> LossCurve:
    """A run directory (or its summary.json); ValueError naming the path when there is none."""
    path = Path(run)
    summary_path = path / "summary.json" if path.is_dir() else path
    if not summary_path.is_file():
        raise ValueError(f"{run}: no summary.json there; give a run's --out directory (a finished or stopped run)")
    try:
        summary = json.loads(summary_path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{summary_path}: not JSON ({err.msg} at line {err.lineno})") from None
    return LossCurve.from_summary(summary, label=summary_path.parent.name or str(summary_path.parent))


def draw(curves: list[LossCurve], out: str | Path, title: str | None = None) -> Path:
    """Loss against step for each curve (validation as markers), tokens on the top axis; PNG at `out`.
    Raises ImportError when matplotlib is missing."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_tasks = any(c.tasks for c in curves)
    if with_tasks:  # the loss above, the lm-eval task scores below, on the same steps
        fig, (ax, task_ax) = plt.subplots(2, 1, figsize=(8, 7.2), dpi=110, sharex=True, height_ratios=(3, 2))
    else:
        fig, ax = plt.subplots(figsize=(8, 4.8), dpi=110)
    for i, curve in enumerate(curves):
        color = f"C{i % 10}"
        prefix = f"{curve.label}: " if len(curves) > 1 else ""
        ax.plot(curve.steps, curve.losses, color=color, linewidth=1.2, label=f"{prefix}train")
        if curve.val_steps:
            ax.plot(curve.val_steps, curve.val_losses, color=color, marker="o", linestyle="--", linewidth=1,
                    markersize=4, label=f"{prefix}validation")
    ax.set_xlabel("" if with_tasks else "step")  # the task panel below carries the step axis
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    per_step = {c.per_step for c in curves}
    if len(per_step) == 1 and (scale := per_step.pop()) > 0:  # a second axis only when all runs agree
        top = ax.secondary_xaxis("top", functions=(lambda s: s * scale, lambda t: t / scale))
        top.set_xlabel(curves[0].unit)
    ax.set_title(title or (curves[0].label if len(curves) == 1 else "loss"), fontsize=10)
    if with_tasks:
        _draw_tasks(task_ax, curves)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with replacing(out) as f:
        fig.savefig(f, format=out.suffix.lstrip(".") or "png")
    plt.close(fig)
    return out


def _draw_tasks(ax, curves: list[LossCurve]) -> None:  # noqa: ANN001 -- a matplotlib Axes
    """Each run's task scores against step: scores in [0, 1] (accuracies) on the left axis, the others
    (perplexities) on a log-scaled right axis, so neither squashes the other."""
    styles = ["-", "--", ":", "-."]
    right = None
    names = sorted({name for curve in curves for name in curve.tasks})
    for i, curve in enumerate(curves):
        prefix = f"{curve.label}: " if len(curves) > 1 else ""
        for name, points in sorted(curve.tasks.items()):
            bounded = all(0.0 <= v <= 1.0 for _, v in points)
            if not bounded and right is None:
                right = ax.twinx()
                right.set_yscale("log")
                right.set_ylabel("perplexity-like (log)")
            (right if not bounded else ax).plot(
                [s for s, _ in points], [v for _, v in points], marker="o" if bounded else "s", markersize=4,
                linewidth=1, linestyle=styles[i % len(styles)], color=f"C{names.index(name) % 10}",
                label=f"{prefix}{name}")
    ax.set_xlabel("step")
    ax.set_ylabel("lm-eval score in [0, 1]")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if right is not None:
        more = right.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels, fontsize=7, loc="best")


def write_loss_plot(summary: dict, path: str | Path) -> Path | None:
    """The run's loss.png; None (and one log line) when there is nothing to draw or no matplotlib."""
    curve = LossCurve.from_summary(summary, label=Path(path).parent.name)
    if not curve.losses:
        return None
    try:
        out = draw([curve], path)
    except ImportError:
        log.info("loss.png skipped: %s", MISSING)
        return None
    log.info("wrote %s", out)
    return out


def cmd_plot(args: argparse.Namespace) -> int:
    curves = [read_run(run) for run in args.runs]
    try:
        out = draw(curves, args.out, args.title)
    except ImportError:
        raise ValueError(MISSING) from None
    print(f"wrote {out} ({len(curves)} run{'s' if len(curves) > 1 else ''})")
    return 0


def add_plot_parser(sub: argparse._SubParsersAction) -> None:
    """Register `bigtrain plot` on the CLI's subparsers."""
    p = sub.add_parser("plot", help="overlay the loss curves of runs (their summary.json) in one PNG",
                       description="Training loss per step and validation loss of each run, tokens on the top "
                                   "axis when the runs agree on tokens per step.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories (--out of a run) or summary.json files")
    p.add_argument("--out", default="loss.png", help="PNG to write (default loss.png)")
    p.add_argument("--title", default=None, help="plot title")
    p.set_defaults(func=cmd_plot)
