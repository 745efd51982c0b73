"""The reward model of classic RLHF (seed: "trains a reward model on pairs of responses that people
ranked"): the language model's trunk with a scalar head read at each sequence's last token, trained with
the Bradley-Terry loss on chosen/rejected pairs (as TRL's RewardTrainer):

    L = -log sigmoid(r_chosen - r_rejected)   [+ c * (r_chosen + r_rejected)^2, TRL's center_rewards]

The head is Hugging Face's `score` of `LlamaForSequenceClassification` (a bias-free Linear(dim, 1) on the
final-normed hidden state of the last non-pad token), so the export is that class and transformers scores
identically. Batches are `PairBatch`es (dpo.py): 2b rows, the b chosen then the b rejected; a row's last
token is its last target position + 1 (targets cover the response), read from `targets`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..loss import IGNORE_INDEX, TokenLoss
from .dpo import PairBatch


class RewardModel(nn.Module):
    """A trunk (our Transformer) and its scalar head. `forward(tokens, last)` -> rewards [B] at the
    positions `last` [B]."""

    def __init__(self, trunk: nn.Module, dim: int, init_std: float = 0.02):
        super().__init__()
        self.trunk = trunk
        self.score = nn.Linear(dim, 1, bias=False)
        nn.init.normal_(self.score.weight, std=init_std)
        # The trunk's LM head takes no part in the reward (Hugging Face's class has none): frozen, it gets no
        # gradient, optimizer state or decay, and data parallel neither waits for its gradient (DDP) nor
        # updates it from a zero one (ZeRO-1). Tied to the embedding, it is the embedding: left trainable.
        head, embedding = getattr(trunk, "lm_head", None), getattr(trunk, "embed_tokens", None)
        if head is not None and (embedding is None or head.weight is not embedding.weight):
            head.requires_grad_(False)

    def forward(self, tokens: torch.Tensor, last: torch.Tensor | None = None) -> torch.Tensor:
        """Rewards [B] read at the positions `last` [B]; without `last`, the head at every position [B, S]
        (PPO's critic: V of the prefix up to and including each token). Always through forward, so the hooks
        a parallel layout puts on it run (ZeRO-1's wait for the gathered weights)."""
        hidden = self.trunk(tokens, head=lambda h, _lm_head: h)  # the final-normed hidden states [B, S, D]
        if last is None:
            return self.score(hidden.float()).squeeze(-1)
        picked = hidden[torch.arange(hidden.shape[0], device=hidden.device), last.to(hidden.device)]
        return self.score(picked.float()).squeeze(-1)


def last_positions(batch: PairBatch) -> torch.Tensor:
    """Each row's last token in `inputs`: the position whose target is the response's last token."""
    has = batch.targets != IGNORE_INDEX
    idx = torch.arange(has.shape[1]).expand_as(has)
    return torch.where(has, idx, -1).max(dim=1).values + 1


def whole_sequences(batch: PairBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, S+1]: each row's prompt and response, its last token at `last`; last [B]). The inputs stop
    one token short of each sequence (they are what predicts the targets), so the response's last token, the
    last target, goes in at `last`; what follows it is padding the causal mask keeps out of the reward."""
    last = last_positions(batch)
    rows = torch.arange(batch.inputs.shape[0])
    tokens = F.pad(batch.inputs, (0, 1))
    tokens[rows, last] = batch.targets[rows, last - 1]
    return tokens, last


@dataclass
class BradleyTerry:
    center_rewards: float | None = None  # TRL's center_rewards_coefficient (Eisenstein et al. 2023: 0.01)
    stats: dict[str, float] = field(default_factory=dict)

    def weight(self, batch: PairBatch) -> int:
        return batch.pairs

    def loss(self, model: nn.Module, batch: PairBatch, device: torch.device) -> TokenLoss:
        b = batch.pairs
        tokens, last = whole_sequences(batch)
        rewards = model(tokens.to(device), last.to(device))
        chosen, rejected = rewards[:b], rewards[b:]
        losses = -F.logsigmoid(chosen - rejected)
        if self.center_rewards:
            losses = losses + self.center_rewards * (chosen + rejected) ** 2
        with torch.no_grad():
            for k, v in (("preference_accuracy", (chosen > rejected).float().sum()),
                         ("reward_margin", (chosen - rejected).sum()), ("rewards_chosen", chosen.sum()),
                         ("rewards_rejected", rejected.sum())):
                self.stats[k] = self.stats.get(k, 0.0) + float(v)
            self.stats["pairs"] = self.stats.get("pairs", 0.0) + b
        return TokenLoss(ce_sum=losses.sum(), z_sum=torch.zeros((), device=device), tokens=torch.tensor(b, device=device))

    def pop_metrics(self) -> dict[str, float]:
        n = max(self.stats.pop("pairs", 0.0), 1.0)
        out = {k: v / n for k, v in self.stats.items()}
        self.stats.clear()
        return out
