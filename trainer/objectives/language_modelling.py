"""Pretraining's objective: next-token prediction over packed rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..data import MicroBatch
from ..loss import IGNORE_INDEX, HeadLoss, TokenLoss


@dataclass
class LanguageModelling:
    """Next-token prediction: inputs row[:-1], targets row[1:] (seed: "the target sequence is the input
    shifted one position left")."""

    z_loss: float = 0.0

    def weight(self, batch: MicroBatch) -> int:
        return int((batch.targets != IGNORE_INDEX).sum())

    def loss(self, model: nn.Module, batch: MicroBatch, device: torch.device) -> TokenLoss:
        # The LM head runs fused with the loss when it can (trainer/loss.py HeadLoss): no full logits.
        targets = batch.targets.to(device, non_blocking=True)
        return model(batch.inputs.to(device, non_blocking=True), head=HeadLoss(targets, z_loss=self.z_loss))
