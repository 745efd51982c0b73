"""SFT: next-token cross-entropy on response tokens only (seed: "Same loop as pretraining, but on prompts
paired with good responses ... The loss is computed only on response tokens"). The data side
(trainer/posttrain_data.py) writes IGNORE_INDEX into the targets of every prompt, system and padding
token, so the objective is language modelling over whatever targets survive."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..data import MicroBatch
from ..loss import IGNORE_INDEX, TokenLoss, cross_entropy_sum


@dataclass
class SupervisedFineTuning:
    z_loss: float = 0.0

    def weight(self, batch: MicroBatch) -> int:
        return int((batch.targets != IGNORE_INDEX).sum())

    def loss(self, model: nn.Module, batch: MicroBatch, device: torch.device) -> TokenLoss:
        # packed rows carry document ids; unpacked ones need only the causal mask (and every wrapper takes that)
        extra = {} if batch.documents is None else {"documents": batch.documents.to(device)}
        logits = model(batch.inputs.to(device), **extra)
        return cross_entropy_sum(logits, batch.targets.to(device), z_loss=self.z_loss)

    def pop_metrics(self) -> dict[str, float]:
        return {}
