"""Curves of `history.jsonl` drawn to PNG with matplotlib (imported here, when a plot is asked for)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import MissingDependencyError

__all__ = ["plot_history"]


def plot_history(
    histories: dict[str, list[dict[str, Any]]],
    out_path: Path,
    *,
    metrics: tuple[str, ...] = ("train/reward", "val/reward", "loss/train"),
    title: str | None = None,
    overlay: bool = False,
) -> Path:
    """Draw each metric against `step`, one panel per metric, one line per model.

    Args:
        histories: model label → its history rows (as `read_history` returns them).
        out_path: the PNG file to write.
        metrics: history keys to draw; a metric no model has is left out.
        overlay: draw every metric in one panel (one line per model and metric).

    Returns:
        out_path.

    Raises:
        MissingDependencyError: if matplotlib is not installed.
        ValueError: if no model has any of the metrics.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise MissingDependencyError("plots need matplotlib: pip install matplotlib") from exc

    present = [m for m in metrics if any(m in row for rows in histories.values() for row in rows)]
    if not present:
        raise ValueError(f"no history row has any of {list(metrics)}; train or log a step first")
    panels = [present] if overlay else [[m] for m in present]
    fig, axes = plt.subplots(1, len(panels), figsize=(max(5 * len(panels), 6), 3.6), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for metric in panel:
            for label, rows in histories.items():
                points = sorted((row["step"], row[metric]) for row in rows if row.get(metric) is not None and "step" in row)
                if points:
                    xs, ys = zip(*points)
                    name = " ".join(x for x in (label if len(histories) > 1 else "", metric if overlay else "") if x)
                    ax.plot(xs, ys, marker="o", markersize=3, label=name or None)
        ax.set_title(", ".join(panel))
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(histories) > 1 or overlay:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path
