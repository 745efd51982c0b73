"""The model built on the meta device, before any layout is applied to it."""

from __future__ import annotations

import torch

from infra.config import LifecycleConfig

from .model import Transformer
from .parallel.materialize import materialize


def build_model(cfg: LifecycleConfig, device: torch.device | None = None, seed: int | None = None) -> Transformer:
    """The whole model on the meta device: shapes, no memory. `parallelize(..., device=, seed=)` then
    applies the layout's plans to it and each rank allocates and initialises only its own share, with
    the values one process would hold there (trainer/parallel/materialize.py), so every layout starts
    from the same weights. Given a device and a seed: that one-process model, materialised whole."""
    with torch.device("meta"):
        model = Transformer(cfg.model)
    if device is not None:
        if seed is None:
            raise ValueError("build_model: a device without a seed; the initial weights need both")
        materialize(model, device, seed)
    return model
