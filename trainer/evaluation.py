"""Validation loss: the token-weighted mean cross-entropy of held-out batches, over every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .data import MicroBatch
from .parallel.ddp import unwrap
from .precision import autocast_for
from .step import Objective


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[MicroBatch], objective: Objective, precision: str,
             device: torch.device, dp_group=None) -> float:
    """Token-weighted mean validation cross-entropy over every rank's batches."""
    if getattr(unwrap(model), "pipeline", None) is not None:
        from .parallel.pipeline_evaluate import pipeline_evaluate

        return pipeline_evaluate(unwrap(model), batches, objective, device, precision)
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, device=device)
    for mb in batches:
        with autocast_for(precision, device):
            part = objective.loss(model, mb, device)
        sums += torch.stack([part.ce_sum.float(), part.tokens.float()])
    if dp_group is not None:
        dist.all_reduce(sums, group=dp_group)
    model.train(was_training)
    return float(sums[0] / sums[1].clamp_min(1.0))
