"""The picture of a training job's per-layer activation statistics (trainer/activation_stats.py):
the residual stream's RMS and largest |value| after each block, against the step, one line per layer
(darker is deeper). Drift upward with depth or steps is what to look for before a loss spike."""

from __future__ import annotations

import json
import re
from pathlib import Path

_KEY = re.compile(r"^act_(rms|absmax)/layer_(\d+)$")


def read_activation_stats(metrics_jsonl: Path) -> dict[str, dict[int, list[tuple[int, float]]]]:
    """{"rms" | "absmax": {layer: [(step, value), ...]}} from a job's metrics.jsonl."""
    series: dict[str, dict[int, list[tuple[int, float]]]] = {"rms": {}, "absmax": {}}
    for line in metrics_jsonl.read_text().splitlines():
        row = json.loads(line)
        for key, value in row.items():
            m = _KEY.match(key)
            if m:
                series[m.group(1)].setdefault(int(m.group(2)), []).append((int(row["step"]), float(value)))
    return series


def plot_activation_stats(metrics_jsonl: Path, path: Path, title: str = "", log_figure=None) -> Path | None:
    """activations.png next to the metrics, and through `log_figure(fig, name)` into the run; None when
    the job logged no statistics."""
    series = read_activation_stats(metrics_jsonl)
    if not series["rms"]:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted(series["rms"])
    cmap = plt.get_cmap("viridis")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, kind, label in ((axes[0], "rms", "RMS"), (axes[1], "absmax", "max |x|")):
        for i in layers:
            steps, values = zip(*series[kind][i])
            ax.plot(steps, values, color=cmap(i / max(1, len(layers) - 1)), lw=1.2,
                    label=f"layer {i}" if len(layers) <= 12 or i in (layers[0], layers[-1]) else None)
        ax.set_xlabel("step")
        ax.set_ylabel(f"residual stream {label}")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle(title or "activations after each block")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    if log_figure is not None:
        log_figure(fig, path.name)
    plt.close(fig)
    return path
