"""GRPO (Shao et al. 2024, DeepSeekMath): sample G answers per prompt, score each with a verifiable
reward, and use the reward relative to its group as the advantage, so no value network is needed
(seed: "GRPO samples a group of answers per prompt and uses each answer's reward relative to the
group average as its advantage").

    A_i = (r_i - mean(r_group)) / (std(r_group) + 1e-4)          (std unbiased, as TRL)
    per completion token t:  ratio = exp(logp_t - logp_old_t)
        L_t = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A) + beta * KL_t
        KL_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1          (Schulman's k3 estimator, as GRPO)
               times ratio when kl_ratio_correction (DeepSeek-V3.2; TRL's use_bias_correction_kl, its default):
               the ratio, differentiable, makes the KL gradient the unbiased reverse-KL one
    aggregation over the step, TRL's `loss_type`s:
        dapo     sum of L_t over the step's completion tokens (DAPO: every token weighs the same, whatever
                 its answer's length; TRL's default)
        grpo     each answer's token mean, then the mean over answers (the paper's; biased by length)
        dr_grpo  sum of L_t / (answers * max_new_tokens) (Dr. GRPO: a constant normaliser)
    The loop divides the step's summed loss by the summed `weight`s (over micro-batches and data-parallel
    ranks), so each variant is a choice of what a micro-batch sums and what its weight counts.

Every log-prob (policy, reference, behaviour) is of the distribution the answers were sampled from,
softmax(logits / temperature), as TRL computes them; logp_old are the rollout engine's for the sampled
tokens at that temperature (its logprobs_mode "processed_logprobs"): the behaviour policy, the current one
for on-policy steps and the previous step's with one-step-stale rollouts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol, Sequence

import torch
from torch import nn

from ..data import MicroBatch
from ..loss import IGNORE_INDEX, TokenLoss, target_logps


@dataclass
class Rollout:
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # behaviour policy's log-prob of each completion token
    text: str


class RolloutEngine(Protocol):
    """What GRPO needs from an inference engine: batched sampling with log-probs, and new weights (our
    parameter names) between generations, which also drops any prefix cache. An engine whose
    `copies_in_place` attribute is true copies them into its own tensors and is sent only what a step
    changed; any other is sent every weight."""

    def generate(self, prompts: Sequence[list[int]], samples: int, max_new_tokens: int, temperature: float,
                 seed: int) -> list[list[Rollout]]: ...

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None: ...


@dataclass
class RolloutBatch(MicroBatch):
    """inputs/targets [b, S] (targets IGNORE_INDEX outside the completion); old_logps [b, S] aligned with
    targets; advantages [b]."""

    old_logps: torch.Tensor | None = None
    advantages: torch.Tensor | None = None


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """rewards [n * G] in prompt-major order -> advantages [n * G]."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not make groups of {group_size}")
    g = rewards.float().view(-1, group_size)
    return ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + eps)).view(-1)


def grpo_token_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                    epsilon: float, epsilon_high: float | None = None, beta: float = 0.0,
                    ref_logps: torch.Tensor | None = None, token_weights: torch.Tensor | None = None,
                    kl_ratio_correction: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Summed per-token loss over the mask [b, S] (each token times `token_weights`, broadcast, when given)
    and summed statistics (kl, clipped tokens)."""
    ratio = torch.exp(logps - old_logps)
    adv = advantages.unsqueeze(-1)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + (epsilon_high if epsilon_high is not None else epsilon))
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    stats = {"clipped": ((ratio * adv > clipped * adv) & mask).float().sum()}
    if ref_logps is not None:
        d = ref_logps - logps
        kl = torch.exp(d) - d - 1
        if kl_ratio_correction:
            kl = kl * ratio
        stats["kl"] = (kl * mask).sum().detach()
        if beta > 0:
            per_token = per_token + beta * kl
    if token_weights is not None:
        per_token = per_token * token_weights
    return (per_token * mask).sum(), stats


LossType = Literal["dapo", "grpo", "dr_grpo"]


@dataclass
class GroupRelativePolicy:
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    reference: nn.Module | None = None  # frozen starting model: the KL anchor (needed only to log or use KL)
    temperature: float = 1.0  # the rollouts' sampling temperature: log-probs are of softmax(logits / T)
    loss_type: LossType = "dapo"
    max_new_tokens: int = 1  # dr_grpo's constant: the longest answer a rollout may give
    kl_ratio_correction: bool = True  # the KL term times the ratio (TRL's use_bias_correction_kl default)
    stats: dict[str, float] = field(default_factory=dict)

    def weight(self, batch: RolloutBatch) -> int:
        if self.loss_type == "dapo":
            return int((batch.targets != IGNORE_INDEX).sum())
        return int(batch.targets.shape[0]) * (self.max_new_tokens if self.loss_type == "dr_grpo" else 1)

    def _token_logps(self, model: nn.Module, batch: RolloutBatch, device: torch.device) -> torch.Tensor:
        logits = model(batch.inputs.to(device)).float() / self.temperature
        return target_logps(logits, batch.targets.to(device))

    def loss(self, model: nn.Module, batch: RolloutBatch, device: torch.device) -> TokenLoss:
        mask = batch.targets.to(device) != IGNORE_INDEX
        logps = self._token_logps(model, batch, device)
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = self._token_logps(self.reference, batch, device)
        # grpo: each answer's tokens weigh 1 / its length, so the sum over a micro-batch is the sum of answer means
        per_answer = 1.0 / mask.sum(-1, keepdim=True).clamp_min(1) if self.loss_type == "grpo" else None
        total, st = grpo_token_loss(logps, batch.old_logps.to(device), batch.advantages.to(device), mask,
                                    self.epsilon, self.epsilon_high, self.beta, ref, token_weights=per_answer,
                                    kl_ratio_correction=self.kl_ratio_correction)
        for k, v in st.items():
            self.stats[k] = self.stats.get(k, 0.0) + float(v)
        self.stats["tokens"] = self.stats.get("tokens", 0.0) + float(mask.sum())
        return TokenLoss(ce_sum=total, z_sum=torch.zeros((), device=device), tokens=mask.sum())

    def pop_metrics(self) -> dict[str, float]:
        n = max(self.stats.pop("tokens", 0.0), 1.0)
        out = {("clip_fraction" if k == "clipped" else k): v / n for k, v in self.stats.items()}
        self.stats.clear()
        return out


def pad_rollouts(seqs: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt ids, completion ids) pairs -> inputs and targets [n, S], right-padded, the targets covering
    exactly the completion tokens."""
    S = max(len(p) + len(c) for p, c in seqs) - 1
    inputs = torch.full((len(seqs), S), pad_id, dtype=torch.long)
    targets = torch.full((len(seqs), S), IGNORE_INDEX, dtype=torch.long)
    for i, (p, c) in enumerate(seqs):
        seq = p + c
        inputs[i, :len(seq) - 1] = torch.tensor(seq[:-1])
        if c:
            targets[i, len(p) - 1:len(seq) - 1] = torch.tensor(c)
    return inputs, targets


def rollout_batches(groups: list[list[Rollout]], rewards: list[list[float]], micro_batch_size: int,
                    pad_id: int) -> tuple[list[RolloutBatch], torch.Tensor]:
    """Flatten the groups (prompt-major), compute advantages, and cut right-padded micro-batches whose
    targets cover exactly the completion tokens."""
    flat = [r for g in groups for r in g]
    G = len(groups[0])
    adv = group_advantages(torch.tensor([x for g in rewards for x in g], dtype=torch.float32), G)
    batches = []
    for start in range(0, len(flat), micro_batch_size):
        part = flat[start:start + micro_batch_size]
        inputs, targets = pad_rollouts([(r.prompt_ids, r.completion_ids) for r in part], pad_id)
        old = torch.zeros(inputs.shape)
        for i, r in enumerate(part):
            if r.completion_ids:
                p = len(r.prompt_ids)
                old[i, p - 1:p - 1 + len(r.completion_ids)] = torch.tensor(r.logprobs, dtype=torch.float32)
        batches.append(RolloutBatch(inputs=inputs, targets=targets, rows=torch.arange(start, start + len(part)).numpy(),
                                    old_logps=old, advantages=adv[start:start + len(part)]))
    return batches, adv
