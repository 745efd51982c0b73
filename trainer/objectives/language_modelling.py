"""Pretraining's objective: next-token prediction over packed rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..data import MicroBatch
from ..loss import IGNORE_INDEX, HeadLoss, TokenLoss
from ..model.mtp import targets_ahead


@dataclass
class LanguageModelling:
    """Next-token prediction: inputs row[:-1], targets row[1:] (seed: "the target sequence is the input
    shifted one position left")."""

    z_loss: float = 0.0
    mtp_depth: int = 0  # model.mtp_depth: D multi-token prediction depths (model/mtp.py)
    mtp_weight: float = 0.3  # pretrain.mtp_loss_weight, lambda of DeepSeek-V3's L_MTP = lambda / D sum_k L_k

    def weight(self, batch: MicroBatch) -> int:
        return int((batch.targets != IGNORE_INDEX).sum())

    def loss(self, model: nn.Module, batch: MicroBatch, device: torch.device) -> TokenLoss:
        # The LM head runs fused with the loss when it can (trainer/loss.py HeadLoss): no full logits.
        targets = batch.targets.to(device, non_blocking=True)
        inputs = batch.inputs.to(device, non_blocking=True)
        if not self.mtp_depth:
            return model(inputs, head=HeadLoss(targets, z_loss=self.z_loss))
        # Depth k predicts t_{i+k+1}: the targets rolled by k (no z-loss: it stabilises the main head's logits).
        heads = [HeadLoss(targets_ahead(targets, k, IGNORE_INDEX)) for k in range(1, self.mtp_depth + 1)]
        main, ahead = model(inputs, head=HeadLoss(targets, z_loss=self.z_loss), mtp_heads=heads)
        # lambda / D x each depth's summed loss; the step divides every sum by the step's main target count
        # (depth k has k fewer per row: a mean over S - k tokens taken as over S), which keeps the gradient
        # independent of how the batch is split into micro-batches and ranks.
        main.mtp_total = sum(part.ce_sum for part in ahead) * (self.mtp_weight / self.mtp_depth)
        main.mtp_sums = torch.stack([torch.stack([p.ce_sum.detach().float(), p.tokens.float()]) for p in ahead], dim=1)
        return main
