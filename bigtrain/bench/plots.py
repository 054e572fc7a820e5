"""PNG plots of a sweep (matplotlib, Agg backend): throughput, MFU, memory, step split, ratios."""
from __future__ import annotations

from pathlib import Path

RATIO_TARGET = 0.98


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _bigtrain_rows(rows: list[dict], workload: str) -> list[dict]:
    return [r for r in rows if r.get("ok") and r["runner"] == "bigtrain" and r["workload"] == workload
            and r.get("group") != "settings"]  # those have a table of their own


def _workloads(rows: list[dict]) -> list[str]:
    seen: list[str] = []
    for r in rows:
        if r.get("ok") and r["workload"] not in seen:
            seen.append(r["workload"])
    return seen


def write_plots(rows: list[dict], ratio_records: list[dict], img_dir: Path) -> list[Path]:
    """One PNG per view; returns the paths written (views with no data are skipped)."""
    img_dir = Path(img_dir)
    img_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw, data in (("throughput", _throughput, rows), ("mfu", _mfu, rows), ("memory", _memory, rows),
                             ("step_split", _split, rows), ("vs_baselines", _ratios, ratio_records)):
        path = img_dir / f"bench_{name}.png"
        if draw(data, path):
            written.append(path)
    return written


def _grid(n: int, title: str):
    plt = _plt()
    fig, axes = plt.subplots(1, max(n, 1), figsize=(5.5 * max(n, 1), 4), squeeze=False)
    fig.suptitle(title)
    return plt, fig, axes[0]


def _save(plt, fig, path: Path) -> bool:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _throughput(rows: list[dict], path: Path) -> bool:
    workloads = [w for w in _workloads(rows) if _bigtrain_rows(rows, w)]
    if not workloads:
        return False
    plt, fig, axes = _grid(len(workloads), "bigtrain throughput by strategy (2 ranks)")
    for ax, w in zip(axes, workloads):
        rs = _bigtrain_rows(rows, w)
        tokens = all(r.get("tokens_per_s") for r in rs)
        ax.barh([r["strategy"] for r in rs], [r["tokens_per_s"] if tokens else r["samples_per_s"] for r in rs])
        ax.set_xlabel("tokens/s" if tokens else "samples/s")
        ax.set_title(w)
        ax.invert_yaxis()
    return _save(plt, fig, path)


def _paired_bars(rows: list[dict], path: Path, title: str, bars: tuple, xlabel: str, label, mark=None) -> bool:
    """Per workload, two bars per bigtrain row: `bars` = ((legend, value of a row), (legend, value))."""
    workloads = [w for w in _workloads(rows) if _bigtrain_rows(rows, w)]
    if not workloads:
        return False
    plt, fig, axes = _grid(len(workloads), title)
    for ax, w in zip(axes, workloads):
        rs = _bigtrain_rows(rows, w)
        y = list(range(len(rs)))
        for offset, (legend, value) in zip((-0.2, 0.2), bars):
            ax.barh([i + offset for i in y], [value(r) for r in rs], height=0.4, label=legend)
        ax.set_yticks(y, [label(r) for r in rs])
        if mark is not None:
            ax.axvline(mark, color="gray", linestyle="--", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.set_title(w)
        ax.invert_yaxis()
        ax.legend(fontsize=8)
    return _save(plt, fig, path)


def _mfu(rows: list[dict], path: Path) -> bool:
    bf16 = "vs bf16 peak" if any(r.get("mfu_bf16") for r in rows) else "vs bf16 peak (not measured: no native bf16)"
    return _paired_bars(rows, path, "MFU against the measured matmul peaks",
                        ((bf16, lambda r: 100 * (r["mfu_bf16"] or 0)), ("vs fp32 peak", lambda r: 100 * r["mfu_fp32"])),
                        "MFU %", lambda r: f"{r['strategy']} ({r['precision']})", mark=30)


def _memory(rows: list[dict], path: Path) -> bool:
    return _paired_bars(rows, path, "memory per rank: model states (from the tensors) and peak RSS",
                        (("model states", lambda r: r["model_state_bytes"] / 2**20),
                         ("peak RSS", lambda r: r["peak_rss_bytes"] / 2**20)),
                        "MiB per rank", lambda r: r["strategy"])


def _split(rows: list[dict], path: Path) -> bool:
    rs = [r for r in rows if r.get("ok") and r["runner"] == "bigtrain" and r.get("split_ms")]
    if not rs:
        return False
    plt, fig, axes = _grid(1, "step time split from DeepSpeed's wall-clock timers (median ms per step)")
    ax = axes[0]
    labels = [f"{r['workload']} {r['strategy']}" for r in rs]
    left = [0.0] * len(rs)
    for phase in ("forward", "backward", "step"):
        values = [r["split_ms"].get(phase, 0.0) for r in rs]
        ax.barh(labels, values, left=left, label=phase)
        left = [a + b for a, b in zip(left, values)]
    ax.set_xlabel("ms per optimizer step")
    ax.invert_yaxis()
    ax.legend(fontsize=8)
    fig.set_size_inches(9, 0.35 * len(rs) + 1.5)
    return _save(plt, fig, path)


def _ratios(records: list[dict], path: Path) -> bool:
    if not records:
        return False
    plt, fig, axes = _grid(1, "bigtrain throughput / hand-written deepspeed.initialize loop")
    ax = axes[0]
    values = [r["ratio"] for r in records]
    ax.bar([f"{r['workload']}\n{r['strategy']}" for r in records], values)
    ax.axhline(RATIO_TARGET, color="red", linestyle="--", linewidth=1, label=f"target {RATIO_TARGET}")
    ax.axhline(1.0, color="gray", linewidth=0.5)
    ax.set_ylim(min(0.9, min(values) - 0.02), max(1.06, max(values) + 0.02))
    ax.set_ylabel("ratio")
    ax.legend(fontsize=8)
    return _save(plt, fig, path)
