"""The pictures of a sweep: final validation loss against learning rate per proxy size (with the
chosen best), loss against compute with the fitted power law and the predicted pretrain point, and
(with a mixture axis) the loss of each data mixture per size."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, ax, path: Path, log_figure=None, **grid) -> Path:
    """The common finish of every figure: grid, legend, tight layout, PNG, `log_figure(fig, name)` into
    the run when given, figure closed."""
    ax.grid(True, alpha=0.3, **grid)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    if log_figure is not None:
        log_figure(fig, path.name)
    plt.close(fig)
    return path


def plot_loss_vs_lr(curves: dict[str, dict], path: Path, log_figure=None) -> Path:
    """curves: label -> {"lr": [...], "loss": [...], "best_lr": x, "best_loss": y}; diverged runs drawn as x at the top."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    finite = [v for c in curves.values() for v in c["loss"] if math.isfinite(v)]
    top = max(finite) * 1.02 if finite else 1.0
    for label, c in curves.items():
        pairs = sorted(zip(c["lr"], c["loss"]))
        xs = [p[0] for p in pairs if math.isfinite(p[1])]
        ys = [p[1] for p in pairs if math.isfinite(p[1])]
        (line,) = ax.plot(xs, ys, "o-", label=label)
        bad = [p[0] for p in pairs if not math.isfinite(p[1])]
        if bad:
            ax.plot(bad, [top] * len(bad), "x", color=line.get_color())
        if c.get("best_lr") is not None:
            ax.plot([c["best_lr"]], [c["best_loss"]], "*", ms=12, color=line.get_color())
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("final validation loss")
    ax.set_title("Proxy sweep: loss vs learning rate (star: best, x: diverged)")
    return _save(plt, fig, ax, path, log_figure, which="both")


def plot_loss_vs_compute(C: list[float], L: list[float], labels: list[str], fit, target_c: float,
                         predicted: tuple[float, float], path: Path, actual: float | None = None,
                         log_figure=None) -> Path:
    """The best run per size, the fitted L(C) (None: no curve) and the prediction with +-1 sd."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.plot(C, L, "o", label="best run per size")
    for c, l, lab in zip(C, L, labels):
        ax.annotate(lab, (c, l), textcoords="offset points", xytext=(4, 4), fontsize=7)
    if fit is not None:
        grid = np.geomspace(min(C) / 1.5, target_c * 1.5, 100)
        ax.plot(grid, [fit.predict(g)[0] for g in grid], "-",
                label=f"L = {fit.a:.3g} C^-{fit.b:.3f} + {fit.E:.3f}")
    mean, sd = predicted
    ax.errorbar([target_c], [mean], yerr=[sd if math.isfinite(sd) else 0], fmt="s", capsize=4,
                label=f"predicted pretrain {mean:.3f} +- {sd:.3f}")
    if actual is not None:
        ax.plot([target_c], [actual], "D", label=f"actual {actual:.3f}")
    ax.set_xscale("log")
    ax.set_xlabel("training compute C (FLOPs)")
    ax.set_ylabel("final validation loss")
    ax.set_title("Scaling law over the proxies")
    return _save(plt, fig, ax, path, log_figure, which="both")


def plot_loss_vs_mixture(rows: list[dict], chosen: str | None, path: Path, log_figure=None) -> Path:
    """rows: {"size", "tokens", "mixture", "loss"} (each mixture at its best lr); grouped bars per size."""
    plt = _pyplot()
    label = lambda m: m if m is not None else "pretrain"  # noqa: E731
    mixtures = sorted({label(r["mixture"]) for r in rows})
    groups = sorted({(r["params"], r["tokens"], r["size"]) for r in rows})
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    width = 0.8 / max(1, len(mixtures))
    for j, m in enumerate(mixtures):
        xs, ys = [], []
        for i, (n, d, size) in enumerate(groups):
            hit = [r["loss"] for r in rows if label(r["mixture"]) == m and (r["params"], r["tokens"]) == (n, d)]
            if hit:
                xs.append(i + (j - (len(mixtures) - 1) / 2) * width)
                ys.append(hit[0])
        star = " (chosen)" if m == label(chosen) else ""
        ax.bar(xs, ys, width=width, label=m + star, hatch="//" if star else None)
    finite = [r["loss"] for r in rows if math.isfinite(r["loss"])]
    if finite:
        lo, hi = min(finite), max(finite)
        ax.set_ylim(lo - 0.15 * (hi - lo + 1e-3), hi + 0.15 * (hi - lo + 1e-3))
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{size}\nD={d:.3g}" for _, d, size in groups], fontsize=8)
    ax.set_ylabel("final validation loss (best lr)")
    ax.set_title("Proxy sweep: loss per data mixture (hatched: chosen)")
    return _save(plt, fig, ax, path, log_figure, axis="y")
