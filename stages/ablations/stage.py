"""`run(ctx)`: the ablations stage. Plan the sweep, train the proxies (through `run_proxies`), fit, and
write choice.json, results.json and the plots into the stage output.

Analysis, per proxy size (and token budget): for each batch size, schedule and data mixture, the best
learning rate (fit.best_lr). The data mixture is the one with the lowest loss (at its best settings) at
the largest size; within it, the best run per size is the size's point. Over sizes: the learning rate is
carried to the target's N (fit.transfer_lr); the batch size and schedule are those of the largest size's
best run; the final loss is predicted by L(C) at the pretrain run's compute, or by L(N, D) when budgets
vary. Every proxy is validated on the same rows of the val split (the held-out documents in their
natural proportions, what pretrain's val_loss measures), so losses of different mixtures compare.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

from infra.config import LifecycleConfig
from infra.progress import progress_bar

from ..base import StageContext
from .choice import CHOICE_FILE, apply_choice
from .fit import FitError, best_lr, fit_chinchilla, fit_power_law, transfer_lr
from .plots import plot_loss_vs_compute, plot_loss_vs_lr, plot_loss_vs_mixture
from .proxies import mixture_weights, plan_sweep, target_budget
from .runner import ProxyJob, ProxyResult, RunProxies, default_concurrency, run_proxies_sequential, tokens_fingerprint

_RUNNER: RunProxies | None = None


def use_proxy_runner(runner: RunProxies | None) -> None:
    """Install the runner `run` uses when none is passed (tasks/ablations.py installs the Prefect one,
    so the lifecycle maps proxies as concurrent tasks); None restores the sequential default."""
    global _RUNNER
    _RUNNER = runner


def _finite(x: float) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


def _mixture_label(name: str | None) -> str:
    return name if name is not None else "pretrain"


def choose_mixture(rows: list[dict]) -> str | None:
    """The mixture with the lowest loss (each at its best lr, batch and schedule) at the largest proxy size
    (and its largest budget): the size nearest the target, as for the batch size and schedule."""
    top = max((r["params"], r["tokens"]) for r in rows)
    at_top = [r for r in rows if (r["params"], r["tokens"]) == top]
    return min(at_top, key=lambda r: r["loss"])["mixture"]


def analyse(cfg: LifecycleConfig, results: list[ProxyResult]) -> dict[str, Any]:
    """The choice from proxy results (pure: no files, no runs)."""
    groups: dict[tuple, dict[tuple, list[ProxyResult]]] = defaultdict(lambda: defaultdict(list))
    for r in results:
        p = r.proxy
        groups[(p.size, p.budget)][(p.axes["global_batch_size"], p.axes["schedule"], p.axes.get("mixture"))].append(r)
    several = {k: len({sub[i] for subs in groups.values() for sub in subs}) > 1 for i, k in enumerate(("b", "s", "m"))}
    # The best lr of every (size, budget, batch, schedule, mixture).
    bests: dict[tuple, list[tuple]] = defaultdict(list)
    curves: dict[str, dict] = {}
    for (size, budget), subs in groups.items():
        for (gbs, schedule, mixture), rs in subs.items():
            if not any(math.isfinite(r.val_loss) for r in rs):
                continue
            b = best_lr([r.proxy.axes["lr"] for r in rs], [r.val_loss for r in rs])
            label = f"{size} D={rs[0].proxy.tokens:.3g}" + (f" b{gbs}" if several["b"] else "") + \
                    (f" {schedule}" if several["s"] else "") + (f" {_mixture_label(mixture)}" if several["m"] else "")
            curves[label] = {"lr": [r.proxy.axes["lr"] for r in rs], "loss": [r.val_loss for r in rs],
                             "best_lr": b.lr, "best_loss": b.loss}
            bests[(size, budget)].append((b, gbs, schedule, mixture, rs[0].proxy))

    # Data mixture: compared on the losses runs reached, each mixture at its own best settings; every
    # proxy is validated on the same held-out rows (the val split: every held-out document once, in
    # the sources' natural proportions), which is also what pretrain's val_loss measures.
    mixture_rows = []
    for (size, budget), cands in bests.items():
        for mixture in sorted({c[3] for c in cands}, key=_mixture_label):
            b, gbs, schedule, _, p = min((c for c in cands if c[3] == mixture), key=lambda c: c[0].measured_loss)
            mixture_rows.append({"size": size, "params": p.params, "tokens": p.tokens, "budget": budget,
                                 "mixture": mixture, "lr": b.lr, "loss": b.measured_loss,
                                 "global_batch_size": gbs, "schedule": schedule})
    mixture_rows.sort(key=lambda r: (r["params"], r["tokens"], _mixture_label(r["mixture"])))
    mixture = choose_mixture(mixture_rows) if mixture_rows else None

    per_size = []
    for (size, budget), cands in bests.items():
        cands = [c for c in cands if c[3] == mixture]
        if not cands:
            continue
        b, gbs, schedule, _, p = min(cands, key=lambda c: c[0].measured_loss)
        # The scaling law is fitted on losses runs reached: a parabola through three points can dip well
        # below all of them, and the pretrain run will not sit exactly at the vertex either.
        per_size.append({"size": size, "params": p.params, "tokens": p.tokens, "flops": p.flops, "budget": budget,
                         "lr": b.lr, "loss": b.measured_loss, "vertex_loss": b.loss, "method": b.method,
                         "global_batch_size": gbs, "schedule": schedule, "mixture": mixture})
    if not per_size:
        raise FitError("ablations: every proxy diverged; lower the swept learning rates")
    per_size.sort(key=lambda r: (r["params"], r["tokens"]))

    # Learning rate carried to the target size: per size the best at its largest budget.
    by_size: dict[str, dict] = {}
    for row in per_size:
        if row["size"] not in by_size or row["tokens"] > by_size[row["size"]]["tokens"]:
            by_size[row["size"]] = row
    largest = max(by_size.values(), key=lambda r: r["params"])
    swept = [r.proxy.axes["lr"] for r in results]
    target_n = target_budget(cfg)["params"]
    lr = transfer_lr([r["params"] for r in by_size.values()], [r["lr"] for r in by_size.values()], target_n,
                     (min(swept), max(swept)), cfg.ablations.lr_transfer)
    choice: dict[str, Any] = {"lr": lr.lr, "global_batch_size": largest["global_batch_size"],
                              "schedule": largest["schedule"], "data_mixture": mixture_weights(cfg, mixture),
                              "data_mixture_name": mixture, "lr_transfer": lr.as_dict(), "per_size": per_size,
                              "proxies": len(results),
                              "diverged": sum(1 for r in results if not math.isfinite(r.val_loss))}
    if several["m"] or mixture is not None:
        winners = {}
        for r in mixture_rows:
            key = (r["size"], r["budget"])
            if key not in winners or r["loss"] < winners[key]["loss"]:
                winners[key] = r
        choice["mixtures"] = {
            "validation": "the tokens artifact's val split: every held-out document once, sources in their natural "
                          "proportions; the same rows for every proxy and for pretrain's val_loss",
            "chosen_at": "the largest proxy size",
            "per_size": mixture_rows,
            "winner_per_size": {f"{k[0]} D={k[1]}": v["mixture"] for k, v in winners.items()},
            "consistent": len({v["mixture"] for v in winners.values()}) == 1,
        }

    # The prediction is for the run pretrain will actually make (with the choice applied).
    run_cfg, taken = apply_choice(cfg, choice)
    target = target_budget(run_cfg)
    choice["target"] = target
    choice["adopted_by_pretrain"] = taken
    budgets_vary = len({r["tokens"] / r["params"] for r in per_size}) > 1 and \
        any(sum(1 for x in per_size if x["size"] == s) > 1 for s in by_size)
    prediction: dict[str, Any] = {"val_loss": None, "std": None, "law": None, "note": ""}
    try:
        if budgets_vary:
            fit = fit_chinchilla([r["params"] for r in per_size], [r["tokens"] for r in per_size],
                                 [r["loss"] for r in per_size])
            mean, sd = fit.predict(target["params"], target["tokens"])
            prediction.update(law="L(N,D) = E + A/N^alpha + B/D^beta")
        else:
            fit = fit_power_law([r["flops"] for r in per_size], [r["loss"] for r in per_size])
            mean, sd = fit.predict(target["flops"])
            prediction.update(law="L(C) = a*C^-b + E")
        prediction.update(val_loss=mean, std=_finite(sd), fit=fit.as_dict())
        if not math.isfinite(sd):
            prediction["note"] = "no uncertainty: as many points as parameters (add a proxy size)"
    except FitError as exc:
        fit = None
        prediction["note"] = str(exc)
    choice["prediction"] = prediction
    choice["_curves"] = curves
    choice["_fit"] = fit
    return choice


def check_mixtures(train_dir: Path, mixtures: list[dict[str, float]]) -> None:
    """Before any job starts: the tokens' train split records its sources and holds rows of every
    source a mixture weights (the trainer's loader would refuse otherwise, one proxy at a time)."""
    if not mixtures:
        return
    from trainer.data import MixtureOrder, source_ranges
    from trainer.shards import PackedShards

    ranges = source_ranges(PackedShards(train_dir))
    if ranges is None:
        raise ValueError(f"{train_dir}: the tokens artifact does not record which rows hold which source (packed "
                         "before data mixtures existed); re-run the tokens stage to sweep data mixtures")
    for weights in mixtures:
        MixtureOrder(ranges, weights, 0, str(train_dir))


def _skipped(ctx: StageContext) -> dict[str, Any]:
    choice = {"skipped": True, "reason": "ablations.enabled is false"}
    (ctx.out_dir / CHOICE_FILE).write_text(json.dumps(choice, indent=2))
    return {"skipped": True}


def run(ctx: StageContext, run_proxies: RunProxies | None = None,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    cfg = ctx.cfg
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    if not cfg.ablations.enabled:
        return _skipped(ctx)
    if "tokens" not in ctx.inputs:
        raise ValueError(f"the ablations stage needs a 'tokens' input (packed token splits); got {sorted(ctx.inputs)}")
    tokens_dir = Path(ctx.inputs["tokens"])
    tokens_uri = ctx.input_uris.get("tokens") or str(tokens_dir.resolve())
    points = plan_sweep(cfg)
    check_mixtures(tokens_dir / "train", [p.train["data_mixture"] for p in points if p.train.get("data_mixture")])
    job = ProxyJob(config=cfg.model_dump(mode="json"), tokens_uri=tokens_uri,
                   tokens_fingerprint=tokens_fingerprint(tokens_dir, tokens_uri), parent_run_id=ctx.run_id,
                   concurrency=default_concurrency(cfg), threads=cfg.ablations.threads_per_proxy)
    runner = run_proxies or _RUNNER or run_proxies_sequential
    log(f"ablations: {len(points)} proxies over {len({p.size for p in points})} sizes, {job.concurrency} at a time")
    with progress_bar(len(points), "ablations", "proxy") as bar:  # a tick per proxy finished (or found cached)
        results = runner(job, points, done=lambda _result: bar.update())
    if sorted(r.name for r in results) != sorted(p.name for p in points):
        raise RuntimeError(f"ablations: the proxy runner returned {len(results)} results for {len(points)} proxies")

    choice = analyse(cfg, results)
    curves, fit = choice.pop("_curves"), choice.pop("_fit")
    out = ctx.out_dir
    (out / "results.json").write_text(json.dumps([r.as_dict() for r in results], indent=2, default=float))
    (out / CHOICE_FILE).write_text(json.dumps(choice, indent=2, default=float))
    per_size = choice["per_size"]
    pred = choice["prediction"]
    # each picture a PNG in the artifact and, through log_figure, a figure of the stage's run
    plot_loss_vs_lr(curves, out / "loss_vs_lr.png", ctx.log_figure)
    if pred["val_loss"] is not None:
        plot_loss_vs_compute([r["flops"] for r in per_size], [r["loss"] for r in per_size],
                             [r["size"] for r in per_size], fit if pred["law"].startswith("L(C)") else None,
                             choice["target"]["flops"], (pred["val_loss"], pred["std"] or math.inf),
                             out / "scaling_law.png", log_figure=ctx.log_figure)
    if "mixtures" in choice:
        plot_loss_vs_mixture(choice["mixtures"]["per_size"], choice["data_mixture_name"], out / "loss_vs_mixture.png",
                             ctx.log_figure)
    ctx.log_artifact(out / CHOICE_FILE)
    summary: dict[str, Any] = {
        "proxies": len(results), "proxies_trained": sum(1 for r in results if not r.cached),
        "proxies_cached": sum(1 for r in results if r.cached), "diverged": choice["diverged"],
        "chosen_lr": choice["lr"], "chosen_global_batch_size": choice["global_batch_size"],
        "chosen_schedule": choice["schedule"], "target_flops": choice["target"]["flops"],
    }
    if choice["data_mixture_name"] is not None:
        summary["chosen_data_mixture"] = choice["data_mixture_name"]
    if pred["val_loss"] is not None:
        summary["predicted_val_loss"] = pred["val_loss"]
        if pred["std"] is not None:
            summary["predicted_val_loss_std"] = pred["std"]
    def fmt(x):
        return "n/a" if x is None else f"{x:.4g}"

    log(f"ablations: lr={choice['lr']:.4g} batch={choice['global_batch_size']} predicted val_loss="
        f"{fmt(pred['val_loss'])} +- {fmt(pred['std'])}")
    return summary
