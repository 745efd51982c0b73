"""DPO (Rafailov et al. 2023): with implicit rewards r = beta * (log pi(y|x) - log pi_ref(y|x)),
    sigmoid:  L = -log sigmoid(r_chosen - r_rejected)
    IPO (Azar et al. 2023): L = (h - 1 / (2 beta))^2, h = the same log-ratio difference without beta,
        on per-token mean log-probs (as TRL does), so the target margin does not grow with length.
Seed: "DPO skips the reward model and the RL loop: a closed-form loss applied directly to chosen/
rejected pairs." The reference is a frozen copy of the starting model, or log-probs precomputed
into the batch (`PairBatch.ref_logps`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..data import MicroBatch
from ..loss import IGNORE_INDEX, TokenLoss, target_logps


@dataclass
class PairBatch(MicroBatch):
    """inputs/targets hold 2b rows: the b chosen sequences, then the b rejected ones (targets are
    IGNORE_INDEX outside the response). ref_logps: optional [2b] reference sums (or means for IPO)."""

    ref_logps: torch.Tensor | None = None

    @property
    def pairs(self) -> int:
        return self.inputs.shape[0] // 2


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of log p(target) over each row's non-ignored targets, and the count: ([B], [B])."""
    mask = targets != IGNORE_INDEX
    return (target_logps(logits, targets) * mask).sum(-1), mask.sum(-1)


def dpo_loss(pol_chosen: torch.Tensor, pol_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float, kind: str = "sigmoid") -> torch.Tensor:
    """Per-pair loss [b] from the four log-probs [b]."""
    h = (pol_chosen - ref_chosen) - (pol_rejected - ref_rejected)
    if kind == "sigmoid":
        return -F.logsigmoid(beta * h)
    if kind == "ipo":
        return (h - 1.0 / (2.0 * beta)) ** 2
    raise ValueError(f"DPO loss {kind!r}; expected sigmoid or ipo")


@dataclass
class DirectPreference:
    beta: float = 0.1
    kind: str = "sigmoid"
    rpo_alpha: float | None = None  # weight of the chosen answer's per-token NLL (RPO, Pang et al. 2024)
    reference: nn.Module | None = None  # frozen; unused when batches carry ref_logps
    stats: dict[str, float] = field(default_factory=dict)

    def weight(self, batch: PairBatch) -> int:
        return batch.pairs

    def _logps(self, model: nn.Module, batch: PairBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(the loss's log-prob per row: summed, or per-token mean for IPO; the token count per row)."""
        targets = batch.targets.to(device)
        total, count = sequence_logps(model(batch.inputs.to(device)), targets)
        return (total / count.clamp_min(1) if self.kind == "ipo" else total), count

    def loss(self, model: nn.Module, batch: PairBatch, device: torch.device) -> TokenLoss:
        b = batch.pairs
        pol, count = self._logps(model, batch, device)
        if batch.ref_logps is not None:
            ref = batch.ref_logps.to(device).float()
        elif self.reference is not None:
            with torch.no_grad():
                ref = self._logps(self.reference, batch, device)[0]
        else:
            raise ValueError("DPO needs a reference model or precomputed ref_logps in the batch")
        losses = dpo_loss(pol[:b], pol[b:], ref[:b], ref[b:], self.beta, self.kind)
        if self.rpo_alpha:
            # DPO alone lowers both answers' likelihoods while it separates them; the chosen answer's
            # per-token NLL (as TRL's rpo_alpha) keeps it rising, so the model's own ranking improves too
            chosen_mean = pol[:b] if self.kind == "ipo" else pol[:b] / count[:b].clamp_min(1)
            losses = losses - self.rpo_alpha * chosen_mean
        with torch.no_grad():
            r_c, r_r = self.beta * (pol[:b] - ref[:b]), self.beta * (pol[b:] - ref[b:])
            for k, v in (("reward_margin", (r_c - r_r).sum()), ("preference_accuracy", (r_c > r_r).float().sum()),
                         ("logps_chosen", pol[:b].sum()), ("logps_rejected", pol[b:].sum()),
                         ("rewards_chosen", r_c.sum()), ("rewards_rejected", r_r.sum())):
                self.stats[k] = self.stats.get(k, 0.0) + float(v)
            self.stats["pairs"] = self.stats.get("pairs", 0.0) + b
        zero = torch.zeros((), device=device)
        return TokenLoss(ce_sum=losses.sum(), z_sum=zero, tokens=torch.tensor(b, device=device))

    def pop_metrics(self) -> dict[str, float]:
        n = max(self.stats.pop("pairs", 0.0), 1.0)
        out = {k: v / n for k, v in self.stats.items()}
        self.stats.clear()
        return out
