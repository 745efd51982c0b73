"""PPO against a reward model, the optimisation step of classic RLHF (seed: "optimizes the model against it
with PPO, with a KL penalty that keeps it close to the SFT model"; Ouyang et al. 2022), as TRL's PPOTrainer:

  per completion token t of a rollout (the state is the prompt and the tokens before t):
    r_t   = -kl_coef * (log pi_old(t) - log pi_sft(t))          (+ the reward model's score on the last token)
    GAE   delta_t = r_t + gamma V(t+1) - V(t),  A_t = delta_t + gamma lam A_(t+1)   (V after the last token = 0)
    R_t   = A_t + V(t)                                              (the value target)
    A     whitened over the whole batch of rollouts (every data-parallel rank's)
  then for ppo_epochs passes, each cut into minibatches (an optimizer step each), with ratio = pi / pi_old:
    policy loss  max(-A ratio, -A clip(ratio, 1 - c, 1 + c))
    value loss   0.5 max((V - R)^2, (clip(V, V_old - cv, V_old + cv) - R)^2)
    loss = policy + vf_coef * value, averaged over the minibatch's completion tokens

The actor and the critic are one module (`PolicyAndValue`, as TRL's PolicyAndValueWrapper) so one optimizer
step and one gradient clip cover both, and any parallel layout wraps them together. The critic is a
`RewardModel` (reward.py) read at every position: it starts as the trained reward model. Every log-prob is
of softmax(logits / temperature), the distribution the rollouts were sampled from."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..data import MicroBatch
from ..loss import IGNORE_INDEX, TokenLoss, target_logps
from .reward import RewardModel


class PolicyAndValue(nn.Module):
    """forward(tokens) -> (the policy's logits [B, S, V], the critic's values [B, S])."""

    def __init__(self, policy: nn.Module, value: RewardModel):
        super().__init__()
        self.policy, self.value = policy, value

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.policy(tokens), self.value(tokens)


@dataclass
class PPOBatch(MicroBatch):
    """inputs/targets [b, S] (targets IGNORE_INDEX outside the completion); the rest [b, S], aligned with
    targets and 0 outside the completion: the rollout policy's log-probs and values, advantages, returns."""

    old_logps: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None


def token_logps(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T) of each target [B, S] (0-filled where the target is ignored; vocab-parallel
    logits under tensor parallel, loss.target_logps)."""
    return target_logps(logits.float() / temperature, targets) * (targets != IGNORE_INDEX)


def per_token_rewards(scores: torch.Tensor, logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor,
                      kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rewards [B, S]: -kl_coef * (logp - ref) on every completion token plus the score on its last one;
    kl [B, S]: logp - ref, the k1 estimate TRL puts in the reward)."""
    kl = (logps - ref_logps) * mask
    rewards = -kl_coef * kl
    idx = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, idx, -1).max(dim=1).values
    rows = torch.nonzero(last >= 0).squeeze(-1)
    rewards[rows, last[rows]] += scores[rows].to(rewards.dtype)
    return rewards, kl


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) [B, S] by generalised advantage estimation over each row's completion tokens
    (a contiguous run of `mask`); the value after the last token is 0 (the episode ends)."""
    B, S = rewards.shape
    m = mask.to(rewards.dtype)
    adv = torch.zeros_like(rewards)
    running = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    for t in reversed(range(S)):
        cont = m[:, t + 1] if t + 1 < S else torch.zeros_like(running)
        nxt = values[:, t + 1] * cont if t + 1 < S else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * nxt - values[:, t]
        running = delta + gamma * lam * running * cont
        adv[:, t] = running
    adv = adv * m
    return adv, (adv + values) * m


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, group=None) -> torch.Tensor:
    """(x - mean) / std over the masked entries of every rank in `group` (unbiased variance, as TRL's
    masked_whiten); shift_mean False keeps the mean (TRL's reward whitening). 0 outside the mask."""
    m = mask.to(torch.float64)
    xs = x.to(torch.float64)
    sums = torch.stack([(xs * m).sum(), m.sum()])
    if group is not None:
        dist.all_reduce(sums, group=group)
    mean = sums[0] / sums[1].clamp_min(1)
    sq = ((xs - mean) ** 2 * m).sum()
    if group is not None:
        dist.all_reduce(sq, group=group)
    n = sums[1]
    var = sq / n.clamp_min(1) * (n / (n - 1).clamp_min(1))
    out = (xs - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return (out * m).to(x.dtype)


def ppo_token_losses(logps: torch.Tensor, values: torch.Tensor, batch: PPOBatch, mask: torch.Tensor,
                     cliprange: float, cliprange_value: float) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(summed clipped policy loss, summed clipped value loss, summed statistics) over the mask."""
    old, adv, ret, v_old = batch.old_logps, batch.advantages, batch.returns, batch.old_values
    log_ratio = logps - old
    ratio = torch.exp(log_ratio)
    pg1, pg2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - cliprange, 1 + cliprange)
    pg = torch.maximum(pg1, pg2)
    v_clipped = v_old + torch.clamp(values - v_old, -cliprange_value, cliprange_value)
    vf1, vf2 = (values - ret) ** 2, (v_clipped - ret) ** 2
    vf = 0.5 * torch.maximum(vf1, vf2)
    with torch.no_grad():
        stats = {"clip_fraction": ((pg2 > pg1) & mask).float().sum(), "value_clip_fraction": ((vf2 > vf1) & mask).float().sum(),
                 "approx_kl": (0.5 * log_ratio ** 2 * mask).sum(), "ratio": (ratio * mask).sum()}
    return (pg * mask).sum(), (vf * mask).sum(), stats


@dataclass
class ProximalPolicy:
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    temperature: float = 1.0
    stats: dict[str, float] = field(default_factory=dict)

    def weight(self, batch: PPOBatch) -> int:
        return int((batch.targets != IGNORE_INDEX).sum())

    def loss(self, model: nn.Module, batch: PPOBatch, device: torch.device) -> TokenLoss:
        batch = PPOBatch(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.__dict__.items()})
        mask = batch.targets != IGNORE_INDEX
        logits, values = model(batch.inputs)
        logps = token_logps(logits, batch.targets, self.temperature)
        pg, vf, st = ppo_token_losses(logps, values.float(), batch, mask, self.cliprange, self.cliprange_value)
        for k, v in (("policy_loss", pg.detach()), ("value_loss", vf.detach()), *st.items()):
            self.stats[k] = self.stats.get(k, 0.0) + float(v)
        self.stats["tokens"] = self.stats.get("tokens", 0.0) + float(mask.sum())
        return TokenLoss(ce_sum=pg + self.vf_coef * vf, z_sum=torch.zeros((), device=device), tokens=mask.sum())

    def pop_metrics(self) -> dict[str, float]:
        n = max(self.stats.pop("tokens", 0.0), 1.0)
        out = {k: v / n for k, v in self.stats.items()}
        self.stats.clear()
        return out


class AdaptiveKL:
    """The KL coefficient of Ziegler et al. 2019: moved by at most 20% of `n / horizon` per update so the
    per-sequence KL tracks `target`; fixed when target is None."""

    def __init__(self, value: float, target: float | None, horizon: int):
        self.value, self.target, self.horizon = value, target, horizon

    def update(self, kl: float, n: int) -> float:
        if self.target is not None:
            error = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + error * n / self.horizon
        return self.value
