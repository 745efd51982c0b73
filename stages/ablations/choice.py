"""`choice.json`: what the ablations chose, and how pretrain takes it.

Pretrain adopts the chosen learning rate, batch size, schedule and data mixture unless
`ablations.use_ablations` is off or `ablations.pinned` names the field; it reports the predicted final
validation loss next to the measured one (seed: "The big run should hold no surprises").
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from infra.config import LifecycleConfig

CHOICE_FILE = "choice.json"
ADOPTED = ("lr", "global_batch_size", "schedule", "data_mixture")


def read_choice(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / CHOICE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the ablations artifact has no {CHOICE_FILE}")
    return json.loads(path.read_text())


def apply_choice(cfg: LifecycleConfig, choice: dict[str, Any]) -> tuple[LifecycleConfig, dict[str, Any]]:
    """(config pretrain runs with, the values taken). The micro-batch shrinks to divide a new global
    batch over the data-parallel ranks."""
    a = cfg.ablations
    if not a.use_ablations or choice.get("skipped"):
        return cfg, {}
    taken = {k: choice[k] for k in ADOPTED if k not in a.pinned and choice.get(k) is not None
             and choice[k] != getattr(cfg.pretrain, k)}
    if not taken:
        return cfg, {}
    pre = cfg.pretrain.model_dump()
    pre.update(taken)
    per_rank = pre["global_batch_size"] // cfg.parallel.dp
    if pre["global_batch_size"] % cfg.parallel.dp:
        raise ValueError(f"choice.json global_batch_size={pre['global_batch_size']} does not divide over dp={cfg.parallel.dp}; "
                         "pin it with ablations.pinned: [global_batch_size]")
    pre["micro_batch_size"] = math.gcd(per_rank, pre["micro_batch_size"])
    new = LifecycleConfig.model_validate({**cfg.model_dump(), "pretrain": pre})
    return new, taken


def adopt_choice(ctx):
    """The pretrain StageContext with the choice applied (when it has an `ablations` input), and the
    figures pretrain reports beside its own: predicted_val_loss and its standard deviation."""
    if "ablations" not in ctx.inputs:
        return ctx, {}
    choice = read_choice(ctx.inputs["ablations"])
    cfg, taken = apply_choice(ctx.cfg, choice)
    report: dict[str, Any] = {f"ablations_{k}": v for k, v in taken.items()}
    pred = choice.get("prediction") or {}
    if pred.get("val_loss") is not None:
        report["predicted_val_loss"] = pred["val_loss"]
        if pred.get("std") is not None and math.isfinite(pred["std"]):
            report["predicted_val_loss_std"] = pred["std"]
    if taken:
        ctx.log_params({"ablations_choice": taken})
        ctx = replace(ctx, cfg=cfg)
    return ctx, report


def compare_prediction(summary: dict[str, Any]) -> dict[str, float]:
    """Relative error of the prediction, once pretrain measured its final validation loss."""
    pred, actual = summary.get("predicted_val_loss"), summary.get("val_loss")
    if pred is None or actual is None or not actual:
        return {}
    return {"prediction_error": (pred - actual) / actual, "prediction_abs_error": abs(pred - actual) / actual}
